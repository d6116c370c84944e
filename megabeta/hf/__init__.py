"""Hugging Face transformers: a megabeta model as a folder that `transformers` loads
(`AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)`, `AutoTokenizer`), and back.

`layout` names megabeta's config fields and parameters in the folder, `tokenizer` writes the
tokenizer files, `folder` writes and reads the folder; `configuration_beta12` and
`modeling_beta12` are the code the folder carries, which depends on torch and transformers only
(megabeta itself never imports them; transformers is the optional extra `megabeta[eval]`).
"""
