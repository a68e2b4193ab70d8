"""``python -m mpscope ...``: the command line (:mod:`mpscope.cli`), so that
``torchrun --nproc-per-node N -m mpscope run train.py ARGS`` works."""

import sys

from mpscope.cli import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
