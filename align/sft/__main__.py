"""``python -m align.sft``: see ``align.sft``."""

import sys

from align.sft import main

sys.exit(main())
