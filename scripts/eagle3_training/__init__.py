"""Training an EAGLE-3 draft head for a tokenmill target (scripts/train_eagle3.py is the command): the text
(corpus), the target's hidden states and predictions over it (collect), the trainable head and its checkpoint
(head), the training loop (train), and the acceptance the written head gets in tokenmill's engine (measure)."""
