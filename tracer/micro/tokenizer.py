"""The micro model's word-level tokenizer: a `tokenizers` WordLevel model wrapped as `PreTrainedTokenizerFast`.

It is saved beside the weights in a `tokenizer/` subfolder and loads with
`AutoTokenizer.from_pretrained(model_dir, subfolder="tokenizer")` (what `tracer.models.load_model` does). Not in
the model folder itself: for any `model_type: qwen2` folder, transformers 5 forces its own `Qwen2Tokenizer`
(byte-level BPE) whatever `tokenizer_config.json` declares, which would split `b=4` and drop unknown pieces.

Encoding adds `<bos>` in front (like Llama/Qwen-distill tokenizers); decoding joins words with spaces.
"""

from __future__ import annotations

from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

from tracer.tasks.chains import vocabulary

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
TOKENIZER_SUBFOLDER = "tokenizer"
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK)


def build_tokenizer() -> PreTrainedTokenizerFast:
    words = list(SPECIAL_TOKENS) + vocabulary()
    vocab = {word: index for index, word in enumerate(words)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, vocab[BOS])]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        model_max_length=1024,
        clean_up_tokenization_spaces=False,
    )
