"""``python -m workers <stage>``: one stage worker, configured from the environment."""

import logging
import sys

from config.settings import load_settings
from workers.main import run
from workers.queue.messages import Stage

# The level is in every line: `diffcache up` echoes its children's warnings and errors.
logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
run(Stage(sys.argv[1]), load_settings())
