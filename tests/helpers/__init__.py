"""What several test modules share: references, tiny models, stand-ins, distributed workers, paths.

No test module imports another test module; anything a second test needs lives here.
"""
