"""``python -m align.sft``: see ``align.sft``."""

import sys

from align.sft import main

if __name__ == "__main__":
    sys.exit(main())
