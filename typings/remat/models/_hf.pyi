from models._hf import transformers_module as transformers_module
