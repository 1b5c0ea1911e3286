"""Texts and conversations the tokenizer tests encode: several scripts, emoji, code, numbers,
whitespace, inline special tokens; conversations with and without a system prompt."""

TEXTS = [
    "Hello world",
    "héllo wörld, naïve café",
    "日本語のテキスト 世界",
    "emoji 🎉🚀 👩‍💻 done",
    "def f(x):\n    return x ** 2  # square\n",
    "numbers 1234567 and 3.14159, -42, 1e10",
    "line one\n\nline two\r\n\ttabbed  end  ",
    "<|im_start|>user\nspecial tokens inline<|im_end|>",
]
CHATS = [
    [{"role": "user", "content": "What is 2+2?"}],
    [
        {"role": "system", "content": "You answer in French."},
        {"role": "user", "content": "Bonjour, ça va ? 🎉"},
    ],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Name a color."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Another one, with code: `x = [1, 2]`\n"},
    ],
]
