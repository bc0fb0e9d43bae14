import sys

from interop.runner import main

sys.exit(main())
