import sys

from kvsp_app.cli import main

sys.exit(main())
