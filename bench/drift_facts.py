"""Made-up facts for the drift benchmark (bench/bench_drift.py).

These EVALUATION facts choose the defaults; the tests teach a different set
(tests/test_drift.py), so the defaults are not tuned to what the tests check.
Every name is invented; `key` is the word a correct answer must contain.
"""

EVAL_FACTS = [
    ("What is the capital of Velmora?", "The capital of Velmora is Quenlith.", "Quenlith"),
    ("Who invented the skyloom?", "The skyloom was invented by Odessa Thrane.", "Thrane"),
    ("What is the national bird of Ostrevia?", "The national bird of Ostrevia is the copper wren.", "copper wren"),
    ("What is the tallest tower in Marisport?", "The tallest tower in Marisport is the Ashveil Spire.", "Ashveil"),
    ("What language do the people of Dunmarrow speak?", "The people of Dunmarrow speak Kelvari.", "Kelvari"),
    ("What is the currency of Tessaly Isle?", "The currency of Tessaly Isle is the brindle.", "brindle"),
]


def chat_examples(facts):
    return [{"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]} for q, a, _ in facts]


# General prompts outside the shipped anchor set: the regularizer never trains
# on them, so their drift shows whether it holds beyond what it rehearses.
UNSEEN_PROMPTS = [
    "What is the capital of Italy?",
    "How many hours are in a day?",
    "What do cows drink?",
    "Who was the first president of the United States?",
    "What is 12 plus 15?",
    "Name a fruit that is yellow.",
    "What is the largest desert in the world?",
    "What is the opposite of 'early'?",
    "Why do leaves change color in the fall?",
    "What does a baker make?",
    "How many sides does a triangle have?",
    "What is the main language spoken in Germany?",
    "Describe a rainy day in one sentence.",
    "What planet is closest to the Sun?",
    "What is the chemical formula of water?",
    "Give me a word that rhymes with 'cat'.",
    "What do you call a baby dog?",
    "What is the speed of light, roughly?",
    "Which season comes after winter?",
    "How do you say 'thank you' in French?",
]
