from models._settings import NAMES as NAMES
from models._settings import RematSettings as RematSettings
from models._settings import jax_block as jax_block
from models._settings import torch_block as torch_block
