import sys

from thoughtkv.cli import main

sys.exit(main())
