"""SageMaker entry point for a root script whose first argument is a subcommand (tokenize.py train ...).

The container passes hyperparameters as sorted `--key value` pairs, so a subcommand cannot come
first on its own; the launcher sends `--minilm-script tokenize.py --minilm-command train` instead
and this file puts `train` back in front. See minilm_az/launch/sagemaker.py.
"""

import os
import sys

from minilm_az.launch.sagemaker import run_entry

if __name__ == "__main__":
    run_entry(sys.argv[1:], root=os.path.dirname(os.path.abspath(__file__)))
