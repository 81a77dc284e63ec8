"""`python -m keras_mp.cli` runs the `keras-mp` command line."""

import sys

from keras_mp.cli.main import main

sys.exit(main())
