"""Django settings for kvserve, split by concern; every value that varies per deployment comes from env."""
from kvserve.settings.base import *  # noqa: F401,F403
from kvserve.settings.security import *  # noqa: F401,F403
from kvserve.settings.database import *  # noqa: F401,F403
from kvserve.settings.redis import *  # noqa: F401,F403
from kvserve.settings.celery import *  # noqa: F401,F403
from kvserve.settings.engine import *  # noqa: F401,F403
from kvserve.settings.api import *  # noqa: F401,F403
from kvserve.settings.operations import *  # noqa: F401,F403
