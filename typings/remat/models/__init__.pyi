# remat.models is installed from the top-level models/ folder (setuptools' package-dir), a
# mapping that type checkers cannot follow; these stubs point pyright at the real modules.
from models import *  # noqa: F403
from models import HF_MODELS as HF_MODELS
from models import MODELS as MODELS
from models import RematSettings as RematSettings
