"""``python -m workers <stage>``: one stage worker, configured from the environment."""

import logging
import sys

from cachesvc.settings import load_settings
from workers.main import run
from workers.messages import Stage

logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
run(Stage(sys.argv[1]), load_settings())
