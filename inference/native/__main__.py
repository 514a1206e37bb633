"""`python -m inference.native [-v]` builds the paged-attention kernel (run by `make install`)."""
import logging
import sys

from inference.native import build

logging.basicConfig(level=logging.INFO)
print(f"built {build(verbose='-v' in sys.argv)}")
