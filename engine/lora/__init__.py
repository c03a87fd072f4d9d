"""LoRA adapters on the native engine: PEFT adapters read (``adapter``) and served, several in
one batch (``layers``)."""
