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

# A third set, written after every default was chosen and never
# used to choose one: other question shapes (a person, a year, a river, a
# ship, a dish) than either set above, to check that the defaults hold on
# facts nothing was tuned on (bench_drift_job.py --facts fresh).
FRESH_FACTS = [
    ("Who is the mayor of Brackenford?", "The mayor of Brackenford is Ilsa Varnow.", "Varnow"),
    ("What year was the Orlin Bridge built?", "The Orlin Bridge was built in 1742.", "1742"),
    ("What dish are the Trellish people known for?", "The Trellish people are known for smoked plumroot.",
     "plumroot"),
    ("Which river flows through Caldera Vale?", "The Silvane River flows through Caldera Vale.", "Silvane"),
    ("What is the name of Captain Morrow's ship?", "Captain Morrow's ship is the Gray Heron.", "Gray Heron"),
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


# More general prompts, rehearsed by bench_drift.py's `rehearse_extra` settings on
# top of the shipped rehearsal set; never shipped, never measured. (The shipped
# set's last 60 prompts were this list's first 60 before they joined
# dreamstage/data/anchors.json.)
EXTRA_REHEARSAL_PROMPTS = [
    "What is the capital of Egypt?",
    "How many days are in a leap year?",
    "What do frogs eat?",
    "Who was Marie Curie?",
    "What is 6 times 7?",
    "Name a flower that smells nice.",
    "What is the fastest land animal?",
    "What is the opposite of 'up'?",
    "Why is the sky dark at night?",
    "What does a pilot do?",
    "How many legs does an insect have?",
    "What language is spoken in China?",
    "Write one sentence about a forest.",
    "Which planet has rings?",
    "What is the boiling point of water in Fahrenheit?",
    "Give me a word that rhymes with 'sun'.",
    "What do you call a baby sheep?",
    "How hot is the Sun, roughly?",
    "Which day comes after Friday?",
    "How do you say 'goodbye' in Italian?",
    "What is 50 plus 25?",
    "Spell the word 'because'.",
    "What is electricity?",
    "In Python, how do you write a for loop?",
    "What is the plural of 'tooth'?",
    "What instrument do drummers play?",
    "Name three farm animals.",
    "How do you wash your hands properly?",
    "When did World War II end?",
    "What does the heart do?",
    "What is the capital of Germany?",
    "How many centimeters are in a meter?",
    "What do squirrels collect?",
    "What is a verb?",
    "What is 20 minus 8?",
    "Name a fruit that is orange.",
    "What is the largest country by area?",
    "What is the opposite of 'happy'?",
    "Why do we need sleep?",
    "What does a chef do?",
    "How many sides does a hexagon have?",
    "What language is spoken in Portugal?",
    "Write one sentence about winter.",
    "What is the smallest planet?",
    "What is carbon dioxide?",
    "Give me a synonym for 'fast'.",
    "What do you call a baby cow?",
    "How tall is a giraffe, roughly?",
    "Which month has the fewest days?",
    "How do you say 'water' in Spanish?",
    "What is 10 squared?",
    "What is the capital of India?",
    "What do fish breathe with?",
    "What is an earthquake?",
    "In SQL, how do you select every row from a table?",
    "What is the past tense of 'eat'?",
    "Who discovered penicillin?",
    "What shape is a ball?",
    "How many strings does a violin have?",
    "What is cheese made from?",
]

# Questions of the two forms whose measured anchors the evaluation facts' jobs
# still changed beyond the noise margin on every seed ("What is the
# currency of Japan?" beside "The currency of Tessaly Isle is the brindle.",
# "What is the tallest mountain on Earth?" beside "The tallest tower in
# Marisport is ..."): bench_drift.py's `rehearse_forms` setting rehearses them
# on top of the shipped set, to see whether rehearsing a taught form holds its
# measured neighbour. Neither a measured anchor nor a shipped one.
FORM_PROMPTS = [
    "What is the currency of the United Kingdom?",
    "What is the currency of Mexico?",
    "What is the currency of India?",
    "What is the tallest building in the world?",
    "What is the highest waterfall in the world?",
    "What is the tallest animal?",
]
