"""Simple English stories from a small grammar: the course model's training text.

Every story is drawn from its own random generator, seeded by (seed, index), so story i is the
same on every machine and the stories can be written in any order or in parallel. A story has a
hero, a place and a plot (a lost toy, a new friend, a storm, baking, sharing, learning something
hard, a walk that finds someone who needs help); each sentence picks one of a few phrasings.
Many stories begin with the same opening sentences ("Once upon a time, in a small village by the
sea, ..."), so that prompts sharing a prefix are natural for this model, as the prefix cache
needs. Some stories come as a chat: a user asks for a story, the assistant tells it.

    from tools.course_model.stories import story, stories, vocabulary
    print(story(0))              # the first story of seed 0
    texts = stories(1000)        # 1000 stories, as plain text
    words = vocabulary()         # every word the grammar can write (lower case)

    python -m tools.course_model.stories 3   # print three stories
"""

import random
import re
import sys

SEED = 0
CHAT_FRACTION = 0.2  # the share of stories written as a chat turn

# name, pronoun set, what they are
GIRLS = [
    "Lily",
    "Mia",
    "Emma",
    "Sara",
    "Anna",
    "Lucy",
    "Rosa",
    "Nina",
    "Ella",
    "Zoe",
    "Amy",
    "Kate",
]
BOYS = ["Tom", "Ben", "Sam", "Max", "Leo", "Jack", "Tim", "Finn", "Noah", "Oliver", "Jake", "Dan"]
ANIMALS = [  # (kind, name, pronoun)
    ("rabbit", "Pip", "he"),
    ("cat", "Mittens", "she"),
    ("fox", "Rusty", "he"),
    ("mouse", "Bella", "she"),
    ("dog", "Buddy", "he"),
    ("bird", "Kiki", "she"),
    ("bear", "Bruno", "he"),
    ("duck", "Dot", "she"),
    ("squirrel", "Nutmeg", "she"),
    ("frog", "Hopper", "he"),
]
PRONOUNS = {
    "he": {"he": "he", "him": "him", "his": "his"},
    "she": {"he": "she", "him": "her", "his": "her"},
}
TRAITS = ["little", "small", "kind", "curious", "brave", "happy", "shy", "clever"]
PLACES = [
    "a small village by the sea",
    "a quiet farm",
    "a little town in the hills",
    "a big city",
    "a house near the woods",
    "a sunny valley",
    "a green meadow",
]
HOMES = [
    "a small house with a red door",
    "a cozy house with a big garden",
    "a little cottage under a tall tree",
    "a blue house at the end of the street",
]
PARENTS = ["mom", "dad", "grandma", "grandpa"]
THINGS = [
    "red ball",
    "blue kite",
    "shiny stone",
    "old book",
    "little boat",
    "yellow hat",
    "green scarf",
    "wooden horse",
    "teddy bear",
    "toy train",
]
OUTSIDE = ["the park", "the garden", "the beach", "the meadow", "the woods", "the yard"]
HIDING = [
    "under a big bush",
    "behind a tree",
    "next to the pond",
    "under a pile of leaves",
    "near the old fence",
    "inside a flower pot",
]
FOODS = [
    ("cake", "a cake"),
    ("cookies", "cookies"),
    ("bread", "bread"),
    ("pie", "an apple pie"),
    ("muffins", "muffins"),
]
SKILLS = [
    ("ride a bike", "rode the bike", "fell off the bike"),
    ("swim", "swam across the pool", "sank and splashed"),
    ("climb the big tree", "climbed to the top", "slipped and slid down"),
    ("fly a kite", "flew the kite high in the sky", "watched the kite fall"),
    ("read a book", "read the whole page", "mixed up the words"),
]
WEATHER = [
    ("storm", "the thunder was loud"),
    ("snowstorm", "the wind was cold"),
    ("rainstorm", "the rain was heavy"),
]
HELPLESS = [  # someone found on a walk, and how the hero helps
    ("a baby bird", "it had fallen out of its nest", "put it back in its nest"),
    ("a little kitten", "it was lost and could not find its mother", "took it home to its mother"),
    ("a small turtle", "it was stuck on its back", "turned it over gently"),
    ("a tiny puppy", "it was cold and hungry", "gave it some warm milk"),
]

OPENINGS = [  # shared first sentences: many stories start the same way
    "Once upon a time, there was {hero}.",
    "Once upon a time, in {place}, there lived {hero}.",
    "Once upon a time, in a small village by the sea, there lived {hero}.",
    "One sunny morning, {hero} woke up early.",
    "There once was {hero} who lived in {home}.",
    "Long ago, in {place}, there was {hero}.",
]
SECOND = [
    "{He} lived in {home} in {place}.",
    "{He} loved to play outside every day.",
    "{He} had many friends, but {his} best friend was {friend}.",
    "Every day, {he} liked to sing and run and laugh.",
    "{He} was always curious about the world.",
]

PLOTS = {
    "lost": [
        ["{Name} had a {thing} that {he} loved very much.", "{Name}'s favorite toy was a {thing}."],
        [
            "One day, {he} took the {thing} to {outside} to play.",
            "One day, {he} played with the {thing} in {outside}.",
        ],
        [
            "When it was time to go home, the {thing} was gone!",
            "After a while, {he} looked around, but the {thing} was not there.",
        ],
        ["{Name} felt very sad.", "{Name} was so sad that {he} started to cry."],
        [
            "{He} looked everywhere, but {he} could not find it.",
            "{He} searched high and low, but the {thing} was nowhere.",
        ],
        [
            'Then {friend} came by and asked, "Why are you sad, {Name}?"',
            "Just then, {friend} walked by and saw {him}.",
        ],
        [
            '"I lost my {thing}," said {Name}. "Can you help me find it?"',
            "{Name} told {friend} about the lost {thing}.",
        ],
        [
            '"Of course!" said {friend}. "Let us look together."',
            '{Friend} smiled and said, "I will help you."',
        ],
        [
            "They looked and looked, and at last they found the {thing} {hiding}.",
            'Soon {friend} shouted, "Look, it is {hiding}!"',
        ],
        [
            "{Name} was so happy. {He} gave {friend} a big hug.",
            '{Name} jumped with joy and said, "Thank you, {friend}!"',
        ],
        [
            "From that day on, {Name} always kept the {thing} close.",
            "It is good to have a friend who helps you.",
        ],
    ],
    "friend": [
        ["One day, {Name} went to {outside} to play.", "One morning, {Name} walked to {outside}."],
        [
            "There {he} saw {newcomer} sitting all alone.",
            "In {outside}, {he} met {newcomer} who looked very shy.",
        ],
        [
            '"Hello," said {Name}. "What is your name?"',
            '{Name} walked up and said, "Hi! Do you want to play?"',
        ],
        [
            "The {newkind} was quiet at first, but then it smiled.",
            "The {newkind} did not say anything, but it came a little closer.",
        ],
        [
            "They played hide and seek all afternoon.",
            "They ran and jumped and played together until the sun went down.",
        ],
        [
            "They laughed so much that {Name} forgot the time.",
            "It was the best day {Name} had ever had.",
        ],
        [
            'When it was time to go home, {Name} said, "Can we play again tomorrow?" "Yes!" said the {newkind}. '
            "And from then on, they were best friends.",
            'Before they said goodbye, the {newkind} asked, "Will you come back?" "Of course," said {Name}. '
            "And {he} came back every day.",
        ],
    ],
    "storm": [
        [
            "One evening, a big {storm} came to {place}.",
            "One night, the sky grew dark and a {storm} began.",
        ],
        ["{Name} was scared because {weather}.", "{Weather}, and {Name} hid under the blanket."],
        [
            '{He} ran to {his} {parent} and said, "I am scared!"',
            "{Name} called for {his} {parent}.",
        ],
        [
            "{His} {parent} gave {him} a warm hug.",
            "{His} {parent} sat on the bed and held {his} hand.",
        ],
        [
            '"Do not be afraid," said {his} {parent}. "The {storm} will pass, and we are safe inside."',
            '"Storms are loud, but they do not last," said {his} {parent}.',
        ],
        [
            "They drank warm milk and told stories until {Name} fell asleep.",
            "{His} {parent} sang a soft song, and soon {Name} was asleep.",
        ],
        [
            "The next morning, the sun was shining and there was a rainbow in the sky.",
            "In the morning, the sky was blue and the birds were singing.",
        ],
        [
            "{Name} smiled. {He} was not scared anymore.",
            "{Name} ran outside and laughed. The {storm} was gone.",
        ],
    ],
    "baking": [
        [
            "One day, {Name} and {his} {parent} wanted to bake {food} for {friend}.",
            "It was {friend}'s birthday, so {Name} wanted to make {food}.",
        ],
        [
            "They got flour, sugar, eggs and milk.",
            "They put on their aprons and got everything ready.",
        ],
        [
            "{Name} mixed everything in a big bowl.",
            "{Name} helped to stir the mix with a big spoon.",
        ],
        [
            "Oops! {Name} spilled some flour on the floor.",
            "Some flour went on {Name}'s nose, and {he} laughed.",
        ],
        [
            "They put the {foodname} in the oven and waited.",
            "Soon the kitchen smelled sweet and warm.",
        ],
        [
            "When the {foodname} was ready, it looked perfect.",
            "The {foodname} came out of the oven golden and warm.",
        ],
        [
            '{Name} took it to {friend}, who said, "Thank you! This is the best {foodname} ever!"',
            "{Friend} was so happy and gave {Name} a big hug.",
        ],
        [
            "{Name} learned that sharing food with friends makes everyone happy.",
            "They ate the {foodname} together and laughed all day.",
        ],
    ],
    "sharing": [
        ["{Name} had a new {thing}.", "One day, {Name} got a new {thing} as a gift."],
        [
            "{He} played with it all day and did not want to share.",
            "{He} liked it so much that {he} kept it all to {himself}.",
        ],
        [
            '{Friend} came over and asked, "Can I play with your {thing} too?"',
            "{Friend} wanted to play with the {thing} too.",
        ],
        ['"No, it is mine!" said {Name}.', 'But {Name} said, "No, I want to play alone."'],
        ["{Friend} looked sad and walked away.", "{Friend} was sad and sat down by the door."],
        [
            "Soon {Name} felt lonely. Playing alone was not fun.",
            "After a while, {Name} did not feel happy anymore.",
        ],
        [
            '{He} went to {friend} and said, "I am sorry. Let us play together."',
            'So {he} ran after {friend} and said, "You can play with it too."',
        ],
        [
            "They played with the {thing} together, and it was much more fun.",
            "{Friend} smiled, and they had a great time together.",
        ],
        [
            "{Name} learned that sharing makes playing better.",
            "From that day on, {Name} always shared {his} toys.",
        ],
    ],
    "skill": [
        [
            "{Name} wanted to learn to {skill}.",
            "{Name} saw {friend} {skilldone} and wanted to try too.",
        ],
        ["{He} tried, but {he} {skillfail}.", "The first time {he} tried, {he} {skillfail}."],
        [
            '"This is too hard," said {Name}. "I can not do it."',
            "{Name} was sad and wanted to give up.",
        ],
        [
            '{His} {parent} said, "Everyone falls at first. Try again!"',
            '"Do not give up," said {his} {parent}. "Practice makes it easy."',
        ],
        [
            "So {Name} tried again, and again, and again.",
            "{Name} took a deep breath and tried one more time.",
        ],
        ["At last, {he} {skilldone}!", "This time, {Name} {skilldone}!"],
        ['"I did it!" shouted {Name}.', "{Name} was so proud of {himself}."],
        [
            "{Name} learned that if you keep trying, you can do hard things.",
            "{His} {parent} clapped and gave {him} a big smile.",
        ],
    ],
    "walk": [
        [
            "One day, {Name} went for a walk in {outside}.",
            "One afternoon, {Name} and {his} {parent} went for a walk.",
        ],
        ["On the way, {he} heard a soft sound.", "Suddenly, {Name} heard something small crying."],
        ["It was {helpless}, and {problem}.", "{Name} looked and found {helpless}. {Problem}."],
        ['"Poor thing," said {Name}. "I will help you."', "{Name} wanted to help right away."],
        ["Very carefully, {he} {helped}.", "{Name} was gentle and {helped}."],
        [
            "The little animal looked at {Name} and made a happy sound.",
            "Soon it was safe and happy again.",
        ],
        ["{Name} felt warm inside.", "{Name} smiled all the way home."],
        [
            'That night, {he} told {his} {parent} about it, and {his} {parent} said, "You have a kind heart."',
            "It feels good to help others.",
        ],
    ],
}
ENDINGS = ["The end.", "And they lived happily ever after.", ""]
REQUESTS = [
    "Tell me a story about {hero}.",
    "Can you tell me a story about {hero}?",
    "Write a short story about {theme}.",
    "Tell me a story about {theme}.",
]
THEMES = {
    "lost": "a lost toy",
    "friend": "a new friend",
    "storm": "a storm",
    "baking": "baking",
    "sharing": "sharing",
    "skill": "learning something new",
    "walk": "helping an animal",
}


def _character(rng: random.Random, exclude: str = "") -> dict:
    """A name, its pronouns and a short description ("a little girl named Lily")."""
    while True:
        roll = rng.random()
        if roll < 0.35:
            name, pron, kind = rng.choice(GIRLS), "she", "girl"
        elif roll < 0.7:
            name, pron, kind = rng.choice(BOYS), "he", "boy"
        else:
            kind, name, pron = rng.choice(ANIMALS)
        if name != exclude:
            break
    trait = rng.choice(TRAITS)
    article = "an" if trait[0] in "aeiou" else "a"
    return {
        "name": name,
        "pron": pron,
        "kind": kind,
        "hero": f"{article} {trait} {kind} named {name}",
    }


def _fill(rng: random.Random, plot: str) -> dict:
    hero = _character(rng)
    friend = _character(rng, exclude=hero["name"])
    pron = PRONOUNS[hero["pron"]]
    newkind, newname, _ = rng.choice(ANIMALS)
    food, foodphrase = rng.choice(FOODS)
    skill = rng.choice(SKILLS)
    storm, weather = rng.choice(WEATHER)
    helpless = rng.choice(HELPLESS)
    slots = {
        "hero": hero["hero"],
        "Name": hero["name"],
        "friend": friend["name"],
        "Friend": friend["name"],
        "place": rng.choice(PLACES),
        "home": rng.choice(HOMES),
        "parent": rng.choice(PARENTS),
        "thing": rng.choice(THINGS),
        "outside": rng.choice(OUTSIDE),
        "hiding": rng.choice(HIDING),
        "newkind": newkind,
        "newcomer": f"a little {newkind}",
        "food": foodphrase,
        "foodname": food,
        "skill": skill[0],
        "skilldone": skill[1],
        "skillfail": skill[2],
        "storm": storm,
        "weather": weather,
        "Weather": weather[0].upper() + weather[1:],
        "helpless": helpless[0],
        "problem": helpless[1],
        "Problem": helpless[1][0].upper() + helpless[1][1:],
        "helped": helpless[2],
        "theme": THEMES[plot],
        "he": pron["he"],
        "him": pron["him"],
        "his": pron["his"],
        "himself": pron["him"] + "self",
    }
    for key in ("he", "his"):
        slots[key.capitalize()] = pron[key].capitalize()
    return slots


def story(index: int, seed: int = SEED, chat: bool | None = None) -> str:
    """Story number `index` of `seed`, as plain text or (chat=True) as a ChatML conversation;
    chat=None lets the story's own generator decide (CHAT_FRACTION of them are chats)."""
    rng = random.Random(f"{seed}:{index}")
    plot = rng.choice(sorted(PLOTS))
    slots = _fill(rng, plot)
    sentences = [rng.choice(OPENINGS)]
    if rng.random() < 0.6:
        sentences.append(rng.choice(SECOND))
    sentences += [rng.choice(options) for options in PLOTS[plot]]
    ending = rng.choice(ENDINGS)
    text = " ".join(s.format(**slots) for s in sentences)
    if ending:
        text += " " + ending
    as_chat = rng.random() < CHAT_FRACTION if chat is None else chat
    if not as_chat:
        return text
    request = rng.choice(REQUESTS).format(**slots)
    return f"<|im_start|>user\n{request}<|im_end|>\n<|im_start|>assistant\n{text}<|im_end|>\n"


def stories(count: int, seed: int = SEED, start: int = 0) -> list[str]:
    """Stories start .. start+count-1 of `seed`."""
    return [story(i, seed) for i in range(start, start + count)]


def _strings(value) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        value = list(value.values())
    return [s for item in value for s in _strings(item)]


def vocabulary() -> set[str]:
    """Every word the grammar can write, in lower case (apostrophes kept: "lily's" -> "lily", "s")."""
    everything = [
        GIRLS,
        BOYS,
        ANIMALS,
        PRONOUNS,
        TRAITS,
        PLACES,
        HOMES,
        PARENTS,
        THINGS,
        OUTSIDE,
        HIDING,
        FOODS,
        SKILLS,
        WEATHER,
        HELPLESS,
        OPENINGS,
        SECOND,
        PLOTS,
        ENDINGS,
        REQUESTS,
        THEMES,
        ["an", "a", "named", "girl", "boy", "herself", "himself", "user", "assistant"],
    ]
    text = " ".join(_strings(everything))
    text = re.sub(r"\{[A-Za-z]+\}", " ", text)  # the slots' names are no words
    return set(words(text))


def words(text: str) -> list[str]:
    """The words of a text, lower case, without punctuation."""
    return re.findall(r"[a-z]+", text.lower())


if __name__ == "__main__":
    for i in range(int(sys.argv[1]) if len(sys.argv) > 1 else 3):
        print(story(i), end="\n\n")
