"""Running the engine somewhere: flags from config dataclasses (flags.py) and the SageMaker launcher."""
