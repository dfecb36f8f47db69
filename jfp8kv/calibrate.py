"""``python -m jfp8kv.calibrate``: the calibrate command under its documented name (the
command itself is ``jfp8kv.entrypoints.calibrate``)."""

import sys

from jfp8kv.entrypoints.calibrate import main

if __name__ == "__main__":
    sys.exit(main())
