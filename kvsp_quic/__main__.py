import sys

from kvsp_quic.app.cli import main

sys.exit(main())
