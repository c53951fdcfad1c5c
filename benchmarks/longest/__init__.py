"""The longest context one training step survives on this machine, and as memory techniques are added."""
