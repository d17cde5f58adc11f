"""Prompts for distillation data, written for verispec: never benchmark questions.

Two sources:
- `builtin_prompts()`: templates x subjects over ten kinds of request (questions, instructions,
  code, maths, writing, summaries, extraction, translation, rewriting, reasoning), 747 prompts.
- Self-prompts: the target writes them. `question_requests` ask it for a request of some kind
  (a question, creative writing, role-play, maths, a puzzle, code, ...) about a subject (its
  answer becomes a prompt); `passage_requests` ask it for a paragraph, and `summary_prompt`
  wraps that paragraph in a summarise/extract/answer/translate instruction.

Example: builtin_prompts()[0] == "What is photosynthesis?"
"""

from __future__ import annotations

import random

TOPICS = (
    "photosynthesis", "the water cycle", "volcanoes", "black holes", "the immune system",
    "compound interest", "the printing press", "honeybees", "ocean tides", "the internet",
    "electric cars", "sleep", "coffee", "chess", "the Roman Empire", "machine learning",
    "recycling", "earthquakes", "vaccines", "the Moon", "rainforests", "jazz", "bread baking",
    "solar panels", "inflation", "human memory", "bicycles", "glaciers", "the Silk Road",
    "antibiotics", "the stock market", "bird migration", "nuclear power", "the French "
    "Revolution", "plate tectonics", "climate change", "the human heart", "cloud computing",
    "ancient Egypt", "wind turbines", "dinosaurs", "the periodic table", "public libraries",
    "coral reefs", "the Olympic Games", "password security", "mushrooms", "airplanes",
    "democracy", "renewable energy", "the blood-brain barrier", "opera", "desert plants",
    "3D printing", "the speed of light", "urban gardening", "tea", "the Great Wall of China",
    "mental health", "electric guitars",
)

QUESTION_TEMPLATES = (
    "What is {}?",
    "How does {} work?",
    "Why does {} matter to ordinary people?",
    "What are three common misconceptions about {}?",
    "Explain {} to a ten-year-old.",
    "Give a short history of {}.",
    "Write a short quiz of three questions about {}, with answers.",
    "What are the main advantages and disadvantages of {}?",
)

TASKS = (
    "planting tomatoes on a balcony", "preparing for a job interview", "learning a new language",
    "saving money every month", "organising a small birthday party", "running a first 5 km race",
    "cleaning a laptop keyboard", "writing a cover letter", "packing for a weekend trip",
    "keeping houseplants alive", "starting a daily journal", "making a budget spreadsheet",
    "training a puppy to sit", "reducing screen time", "cooking rice on a stove",
    "giving a five-minute presentation", "fixing a flat bicycle tyre", "studying for an exam",
    "moving to a new city", "writing a good password", "painting a small room",
)

INSTRUCTION_TEMPLATES = (
    "Give me five practical tips for {}.",
    "Write a step-by-step guide to {}.",
    "Make a short checklist for {}.",
    "What mistakes do beginners make when {}?",
)

CODE_TASKS = (
    "reverses the words in a sentence", "tells whether a number is prime",
    "counts how often each word appears in a text", "merges two sorted lists into one",
    "removes duplicates from a list but keeps the original order",
    "returns the n-th Fibonacci number", "flattens a nested list",
    "converts a temperature from Celsius to Fahrenheit", "finds the second largest number in a "
    "list", "groups a list of strings by their first letter",
    "checks that every bracket in a string is closed", "computes the median of a list",
)

CODE_TEMPLATES = (
    "Write a Python function that {}.",
    "Write a JavaScript function that {}, with a short comment.",
    "Write a Python function that {}, and two unit tests for it.",
)

CODE_SNIPPETS = (
    "def total(xs):\n    s = 0\n    for x in xs:\n        s += x\n    return s / len(xs)",
    "def last(items):\n    return items[len(items)]",
    "squares = {n: n * n for n in range(10) if n % 2}",
    "for i in range(3):\n    for j in range(i):\n        print(i, j)",
    "def greet(name=None):\n    return 'Hello, ' + name",
)

CODE_SNIPPET_TEMPLATES = (
    "Explain what this Python code does:\n\n{}",
    "Is there a bug in this code? If so, fix it.\n\n{}",
)

MATHS = tuple(
    template.format(a=a, b=b, c=c)
    for a, b, c in ((7, 12, 95), (13, 4, 61), (25, 8, 140), (9, 15, 72), (40, 3, 250),
                    (6, 21, 99), (18, 5, 130), (11, 14, 87))
    for template in (
        "Solve for x: {a}x + {b} = {c}. Show each step.",
        "A shop sells notebooks for {a} dollars each. How much do {b} notebooks cost, and how "
        "much change is left from {c} dollars?",
        "What is {b} percent of {c}? Explain how you worked it out.",
        "A cyclist rides {c} km in {a} hours. What is her average speed?",
    )
)

WRITING = tuple(
    template.format(subject)
    for subject in ("a lighthouse keeper", "the first snow of winter", "a lost umbrella",
                    "a city at night", "an old bicycle", "a market on Saturday morning")
    for template in ("Write a short poem about {}.", "Write a very short story about {}.",
                     "Write a diary entry from the point of view of {}.")
) + tuple(
    f"Write a short, polite email to {recipient} about {subject}."
    for recipient, subject in (("a landlord", "a broken heater"),
                               ("a teacher", "missing a class next week"),
                               ("a neighbour", "a noisy party on Saturday"),
                               ("a manager", "asking for a day off"),
                               ("a customer", "a delayed delivery"))
)

PASSAGES = (
    "The village bakery opens at six every morning. Its owner, Marta, started it twenty years "
    "ago with one oven and a loan from her brother. Today it employs nine people and sells "
    "around four hundred loaves a day, most of them to regular customers who walk in before "
    "work.",
    "Researchers tracked 300 city foxes with small radio collars for two years. They found that "
    "the foxes travelled less than two kilometres a night on average, rarely crossed main "
    "roads, and ate mostly food left out by people rather than hunting.",
    "The museum's new wing will open in October. It holds a collection of maps from the "
    "sixteenth century, a room about the history of navigation, and a workshop where children "
    "can build simple compasses. Tickets for the first week are free.",
    "Last year the school replaced its paper timetables with an online calendar. Teachers say "
    "that fewer students miss room changes, but parents complained that the calendar is hard "
    "to read on old phones, so printed copies are still available at the office.",
    "A storm crossed the coast on Tuesday night with winds of up to 110 km/h. Several roads "
    "were closed because of fallen trees, and about 4,000 homes lost power. Electricity was "
    "restored to most of them by Wednesday afternoon.",
    "The community garden has twenty-four plots, each rented for a year. Gardeners share the "
    "tools in the shed and take turns watering during holidays. A waiting list of thirty "
    "families has led the council to look for a second site.",
)

PASSAGE_INSTRUCTIONS = (
    "Summarise this passage in one sentence.",
    "Summarise this passage in three bullet points.",
    "Write a headline for this passage.",
    "List every number mentioned in this passage and what it refers to.",
    "Extract the people, places and organisations named in this passage.",
    "Write two questions that this passage answers, with their answers.",
    "Using only this passage, answer: what is its main point, and what evidence does it give?",
    "Translate the first two sentences of this passage into French.",
    "Rewrite this passage for a ten-year-old reader.",
)

SENTENCES = (
    "The meeting has been moved to Thursday afternoon.",
    "Please remember to bring your own water bottle.",
    "The library closes early on public holidays.",
    "We are looking for volunteers to help at the book fair.",
    "The train was late because of a signal failure.",
    "Our new menu includes three vegetarian dishes.",
)

SENTENCE_TEMPLATES = (
    "Translate into Spanish: {}",
    "Translate into French: {}",
    "Translate into German: {}",
    "Rewrite this sentence in a more formal tone: {}",
    "Rewrite this sentence so that a young child understands it: {}",
    "Turn this sentence into a question: {}",
)

REASONING = (
    "If every glorp is a snib and some snibs are blue, must some glorps be blue? Explain.",
    "Anna is taller than Ben, and Ben is taller than Cleo. Who is the shortest? Explain.",
    "A box holds red and green marbles, twice as many red as green, 18 in all. How many are "
    "green?",
    "Which weighs more, a kilogram of feathers or a kilogram of iron? Explain why people get "
    "this wrong.",
    "Three friends split a bill of 54 dollars, but one of them pays double the others. How "
    "much does each pay?",
    "If it takes five machines five minutes to make five widgets, how long do a hundred "
    "machines take to make a hundred widgets?",
    "Compare trains and planes for a 500 km trip: list the pros and cons of each.",
    "Compare renting and buying a home: list the pros and cons of each.",
    "A clock shows 3:15. What is the angle between the hour and minute hands?",
    "You have a 3-litre jug and a 5-litre jug. How can you measure exactly 4 litres?",
)

# Subjects for the self-prompts beyond TOPICS: many fields, so that the target's own prompts
# (and the draft's data) are not about sixty subjects only. A draft distilled on narrow prompts
# agrees with the target far less on other prompts (measured: 0.49 on prompts like its
# training prompts, 0.30 on verispec's benchmark prompts, greedy, first draft position).
FIELDS = (
    "medieval castles", "the Renaissance", "the Industrial Revolution", "the Cold War",
    "ancient Greece", "the Ottoman Empire", "the history of medicine", "the space race",
    "quantum computing", "genetics", "evolution", "the human brain", "nutrition", "viruses",
    "probability", "prime numbers", "geometry", "statistics in the news", "algorithms",
    "databases", "computer networks", "cryptography", "robotics", "video games",
    "smartphone batteries", "social media", "online privacy", "open-source software",
    "small businesses", "marketing", "job interviews", "negotiation", "personal finance",
    "taxes", "insurance", "supply chains", "shipping containers", "airports", "railways",
    "city planning", "architecture", "bridges", "skyscrapers", "interior design", "fashion",
    "photography", "film making", "theatre", "classical music", "hip hop", "painting",
    "sculpture", "poetry", "science fiction", "detective novels", "fairy tales", "mythology",
    "philosophy of mind", "ethics of AI", "human rights", "elections", "the law courts",
    "journalism", "advertising", "languages and dialects", "sign language", "translation",
    "football", "tennis", "marathon running", "mountaineering", "sailing", "yoga",
    "cooking with spices", "vegetarian food", "wine making", "cheese", "chocolate", "farming",
    "beekeeping", "forests", "rivers", "deserts", "the Arctic", "weather forecasting",
    "hurricanes", "pollution", "endangered species", "zoos", "pets", "horses", "whales",
    "insects", "fungi", "astronomy", "Mars", "satellites", "telescopes", "time zones",
    "calendars", "board games", "magic tricks", "friendship", "parenting", "ageing",
    "happiness", "habits", "public speaking", "volunteering", "museums", "tourism",
    "festivals", "weddings", "hospitals", "first aid", "dentists", "exercise", "sleep science",
)

# What the target is asked to write: requests of many kinds (questions, creative writing,
# role-play, maths, reasoning, code, science, humanities, advice), each about a subject.
REQUEST_KINDS = (
    "Write one question that a curious person might ask an assistant about {}. "
    "Reply with the question only.",
    "Write one request asking an assistant for a piece of creative writing (a poem, a story, a "
    "letter, a speech or a dialogue) about {}. Reply with the request only.",
    "Write one request asking an assistant to play a character whose life involves {} and to "
    "answer a question in character. Reply with the request only.",
    "Write one maths word problem about {} that takes a few steps to solve. Reply with the "
    "problem only.",
    "Write one logic puzzle or reasoning question set in the world of {}. Reply with the "
    "question only.",
    "Write one programming task related to {} that asks for a short Python function. Reply "
    "with the task only.",
    "Write one question a student might ask about the science or technology behind {}. Reply "
    "with the question only.",
    "Write one essay question about the history, culture or ethics of {}. Reply with the "
    "question only.",
    "Write one request asking an assistant to explain, compare or give advice about {}. Reply "
    "with the request only.",
)
SELF_PASSAGE = "Write a short paragraph of facts about {}."


def builtin_prompts() -> list[str]:
    """Every built-in prompt, in a fixed order (callers shuffle)."""
    prompts = [t.format(topic) for topic in TOPICS for t in QUESTION_TEMPLATES]
    prompts += [t.format(task) for task in TASKS for t in INSTRUCTION_TEMPLATES]
    prompts += [t.format(task) for task in CODE_TASKS for t in CODE_TEMPLATES]
    prompts += [t.format(code) for code in CODE_SNIPPETS for t in CODE_SNIPPET_TEMPLATES]
    prompts += [*MATHS, *WRITING, *REASONING]
    prompts += [summary_prompt(i, p) for p in PASSAGES for i in range(len(PASSAGE_INSTRUCTIONS))]
    prompts += [t.format(s) for s in SENTENCES for t in SENTENCE_TEMPLATES]
    return prompts


def question_requests(count: int, seed: int) -> list[str]:
    """`count` requests that make the target write a prompt: a kind of request (REQUEST_KINDS)
    about a subject (TOPICS, TASKS, FIELDS), both drawn with `seed`."""
    rng = random.Random(seed)
    subjects = TOPICS + TASKS + FIELDS
    return [rng.choice(REQUEST_KINDS).format(rng.choice(subjects)) for _ in range(count)]


def passage_requests(count: int, seed: int) -> list[str]:
    """`count` requests that make the target write a paragraph to be summarised."""
    rng = random.Random(seed)
    return [SELF_PASSAGE.format(rng.choice(TOPICS + FIELDS)) for _ in range(count)]


def summary_prompt(index: int, passage: str) -> str:
    """The `index`-th (cyclically) summarise/extract instruction over a passage."""
    return f"{PASSAGE_INSTRUCTIONS[index % len(PASSAGE_INSTRUCTIONS)]}\n\n{passage.strip()}"
