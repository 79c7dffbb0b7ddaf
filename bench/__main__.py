import signal
import sys

from . import hashseed

hashseed.pin()  # first: a process without the suite's hash seed starts again with it

from .cli import main  # noqa: E402 (after the pin: nothing heavy runs twice)

signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # `python -m bench list X | head` ends quietly
sys.exit(main())
