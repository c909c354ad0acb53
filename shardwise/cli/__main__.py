"""python -m shardwise.cli ...: the shardwise command."""
import sys

from . import main

sys.exit(main())
