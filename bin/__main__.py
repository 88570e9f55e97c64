import sys

from deepinfer.bin.cli import main

sys.exit(main())
