"""TEMPORARY shim (replaced by the real module)."""
def chat_prompt_ids(tokenizer, chat_template, conversation, tools, add_generation_prompt):
    text = tokenizer.apply_chat_template(conversation, tools=tools, tokenize=False, chat_template=chat_template,
                                         add_generation_prompt=add_generation_prompt)
    return text, tokenizer(text, add_special_tokens=False).input_ids
