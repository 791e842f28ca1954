"""Vision towers and projectors of vision-language models: what turns an image into the embeddings that stand
in for its placeholder tokens in the decoder's input."""
