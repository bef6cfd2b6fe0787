from models.tasks import *  # noqa: F403
