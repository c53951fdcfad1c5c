"""End to end against DeepSpeed's ALST: parity, time, memory, the longest S, ALST's gradient defects."""
