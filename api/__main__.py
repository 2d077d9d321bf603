"""``python -m api``: serve the REST API, configured from the environment."""

import uvicorn

from api.app import create_app
from config.settings import load_settings

settings = load_settings()
uvicorn.run(create_app(settings), host=settings.api.host, port=settings.api.port,
            log_level="info")
