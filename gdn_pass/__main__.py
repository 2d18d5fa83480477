import sys

from gdn_pass.cli import main

sys.exit(main())
