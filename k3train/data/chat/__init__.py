"""Chat data for supervised fine-tuning (``data.format: chat``).

* :mod:`~k3train.data.chat.template` -- the checkpoint's chat template rendered as transformers'
  ``apply_chat_template`` renders it (sandboxed jinja2), with the assistant spans.
* :mod:`~k3train.data.chat.messages` -- reading and checking JSONL conversations (one line per error, naming
  file and line).
* :mod:`~k3train.data.chat.prepare` -- ``k3train prepare-data --chat``: tokens + assistant-only loss mask in the
  indexed format (``PREFIX.bin/.idx`` + ``PREFIX.mask.bin/.idx``).
* :mod:`~k3train.data.chat.dataset` -- conversations packed into training rows, the loss on assistant tokens only.
"""
