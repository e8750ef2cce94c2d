"""Text generation with exported language models, without torch: the public face of kiln.runtime.llm.

    import kiln.llm
    gen = kiln.llm.Generator("smollm2.kiln")           # made by `kiln export-llm`
    for event in gen.stream("Why is the sky blue?", chat=True):
        print(event.text, end="", flush=True)

    chat = kiln.llm.ChatSession(gen, system="You are terse.")
    print(chat.ask("Hi!"))

Text needs the optional `tokenizers` and `jinja2` packages (`pip install kiln[llm]`); token ids need nothing more.
"""

from kiln.runtime.llm import *  # noqa: F403 - this module is that package's public name
from kiln.runtime.llm import __all__  # noqa: F401
