"""The served model's tokenizer in the web process (admission, shapes, the model listing, the canary's prompts),
loaded once; the weights are not."""
from functools import lru_cache

from inference.loader import load_tokenizer


@lru_cache(maxsize=1)
def tokenizer_get():
    """(ChatTokenizer, fingerprint, model name) of the served model; weights are not loaded here."""
    return load_tokenizer()
