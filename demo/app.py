"""Spaces-style launcher of the hf-specdec demo: ``python demo/app.py [--host 0.0.0.0] [--port 7860]``.

The app itself lives in the package (`hf_specdec.demo`); ``hf-specdec demo`` starts the same thing.
"""

import sys

from hf_specdec.demo import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
