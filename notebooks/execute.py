"""Re-execute the notebooks in place (outputs included), e.g. on a quiet machine before a release:

    python notebooks/execute.py                          # all of them, with their defaults
    HF_SPECDEC_NOTEBOOK_TOKENS=128 python notebooks/execute.py notebooks/01_quickstart.ipynb

Needs the test extra (nbclient, nbformat, ipykernel, matplotlib).
"""

import sys
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient


def main(paths: list[str]) -> int:
    folder = Path(__file__).resolve().parent
    for path in [Path(p) for p in paths] or sorted(folder.glob("*.ipynb")):
        book = nbformat.read(path, as_version=4)
        t0 = time.perf_counter()
        NotebookClient(
            book, timeout=3600, kernel_name="python3", resources={"metadata": {"path": str(folder)}}
        ).execute()
        nbformat.write(book, path)
        print(f"{path}: executed in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
