import os
import sys

try:  # a working directory that was removed kills torch's import with a oneMKL "FATAL" line: one plain line first
    os.getcwd()
except FileNotFoundError:
    sys.stderr.write(f"{os.path.basename(sys.argv[0])}: error: the working directory no longer exists; cd to another\n")
    sys.exit(2)
