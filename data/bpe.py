"""Training a byte-level BPE: data/train_tokenizer.py's, and dev/tokenizer_compare.py's."""

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from tqdm import tqdm

from training.tokenizer import EOT_TEXT


def train_bpe(documents: list[str], vocab_size: int) -> Tokenizer:
    """A byte-level BPE of at most vocab_size tokens (the 256 bytes, <|endoftext|>, merges) trained on documents."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)  # GPT-2's regex
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOT_TEXT], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # every byte, seen or not
    documents_read = tqdm(documents, desc="counting words", unit="doc", dynamic_ncols=True)
    tokenizer.train_from_iterator(documents_read, trainer=trainer, length=len(documents))
    return tokenizer
