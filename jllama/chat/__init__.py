"""Chat templates: a conversation rendered to prompt text as Hugging Face renders it.

A chat model is trained on conversations laid out in one fixed way (role headers, special
tokens, a default system line). The model's files carry that layout as a Jinja template: GGUF's
`tokenizer.chat_template`, or `chat_template` in Hugging Face's `tokenizer_config.json`. This
package renders such a template the way Hugging Face transformers' `apply_chat_template` does,
so the prompt text is the one the model was trained on. One module per job:

- `messages`: `Message`, `ROLES` and `check_messages`, the conversation a template reads;
- `sandbox`: the sandboxed Jinja environment and the helpers templates call (`raise_exception`,
  `strftime_now`, `tojson`, `{% generation %}`); its limits: `limits` (the size of what a
  step makes, computed before it runs), `bounded` (the sandbox hooks that check them) and
  `watchdog` (time and memory, watched from another thread);
- `template`: `ChatTemplate` (`render`, `render_segments`, and `for_tokenizer`, which fills
  `bos_token` / `eos_token` from the model's tokenizer) and the built-in templates
  `DEFAULT_CHATML` and `LLAMA3_CHAT_TEMPLATE`;
- `segments`: where the messages' contents lie in a render, so a tokenizer parses
  special-token text in the template's text only and keeps a user's `<|im_start|>` plain text.

The variables a template gets: `messages` (a list of `{"role", "content", ...}` dicts),
`add_generation_prompt`, `bos_token`, `eos_token`, `tools=None`, `documents=None`, and any
extra keyword arguments (which override those). Jinja's own rules apply, as in transformers: a
name the template does not get is undefined, which prints as "" and is false, and a trailing
newline at the very end of the template is dropped.

Every failure is a one-line `jllama.errors.ChatError`: a template that does not compile (with
its line number), one that fails as it renders (its line number, or the message it gave
`raise_exception`), one past a limit (named), and a malformed message list.
"""

from jllama.chat.messages import ROLES, Message, check_messages
from jllama.chat.sandbox import (
    MAX_TEMPLATE_GROWTH,
    MAX_TEMPLATE_OUTPUT,
    MAX_TEMPLATE_SECONDS,
    MAX_TEMPLATE_SOURCE,
    MAX_TEMPLATE_VALUE,
)
from jllama.chat.template import (
    DEFAULT_CHATML,
    LLAMA3_CHAT_TEMPLATE,
    ChatTemplate,
    SpecialTokenTokenizer,
)

__all__ = [
    "DEFAULT_CHATML",
    "LLAMA3_CHAT_TEMPLATE",
    "MAX_TEMPLATE_GROWTH",
    "MAX_TEMPLATE_OUTPUT",
    "MAX_TEMPLATE_SECONDS",
    "MAX_TEMPLATE_SOURCE",
    "MAX_TEMPLATE_VALUE",
    "ROLES",
    "ChatTemplate",
    "Message",
    "SpecialTokenTokenizer",
    "check_messages",
]
