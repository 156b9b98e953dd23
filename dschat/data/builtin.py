"""The embedded preference dataset, ``--data_path dschat/builtin``, and the script that makes it.

Rows follow upstream's text convention: ``prompt`` is ``" Human: <question> Assistant:"`` and the
answers start with a space. Every label was decided by :mod:`dschat.gold_judge`: for each prompt
two answers are drawn from a template grammar (friendly / neutral / rude openers, on- or off-topic
facts, friendly / neutral / rude closers, and defects: truncation, repetition, rambling) and the
one the judge scores higher (by at least 0.5) is ``chosen``.

Train and held-out rows use disjoint prompt strings (same topics, different question phrasings
per topic), so held-out evaluation measures generalisation to unseen prompts.

Regenerate (deterministic)::

    python -m dschat.data.builtin --out dschat/data/builtin_prefs
"""
from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from dschat.errors import UserError, cli_main
from dschat.gold_judge import gold_score
from dschat.paths import BUILTIN_DATA_DIR, BUILTIN_SAMPLES_DIR
from dschat.runtime.fs import atomic_files, check_writable_dir

NAME = "dschat/builtin"
SPLITS = ("train", "eval")
DEFAULT_SEED = 1234
DEFAULT_TRAIN_ROWS = 3000
DEFAULT_EVAL_ROWS = 300
MIN_MARGIN = 0.5


def data_dir() -> Path:
    """Folder holding ``train.jsonl`` and ``eval.jsonl`` (shipped inside the package)."""
    return BUILTIN_DATA_DIR


def samples_dir() -> Path:
    """Folder of ``dschat/builtin-samples`` (pairs of an SFT actor's answers; dschat.eval.sample_pairs)."""
    return BUILTIN_SAMPLES_DIR


def split_file(split: str, folder: Path | None = None) -> Path:
    if split not in SPLITS:
        raise ValueError(f"builtin dataset split must be one of {SPLITS}, not {split!r}")
    return (folder or data_dir()) / f"{split}.jsonl"


def read_rows(split: str, folder: Path | None = None) -> list[dict]:
    """The rows of one split (of ``folder``, default this dataset's) as dicts with ``prompt``,
    ``chosen``, ``rejected``."""
    text = split_file(split, folder).read_text(encoding="utf-8")
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def distinct_prompts(split: str) -> list[str]:
    """The distinct prompts of one split of ``dschat/builtin``, in first-appearance order (the files
    are shuffled)."""
    return list(dict.fromkeys(row["prompt"] for row in read_rows(split)))


# --------------------------------------------------------------------------------------------
# The grammar. Facts mention their topic word, so an on-topic answer is "relevant" to the judge;
# facts never contain a warm or rude marker (tests/data/test_builtin_dataset.py checks both).
# --------------------------------------------------------------------------------------------
TOPICS: dict[str, tuple[str, ...]] = {
    "volcanoes": (
        "Volcanoes form where molten rock rises through cracks in the crust.",
        "A volcano can stay quiet for centuries before it erupts again.",
        "Lava from volcanoes cools into new rock and can build whole islands.",
        "Some volcanoes sit under the sea, far from where anyone can see them.",
    ),
    "honey bees": (
        "Honey bees live in colonies with one queen and thousands of workers.",
        "Bees make honey from flower nectar and store it in wax cells.",
        "A honey bee tells its sisters where flowers are by dancing.",
        "Bees help farmers because they carry pollen between plants.",
    ),
    "the moon": (
        "The moon takes about a month to travel around the Earth.",
        "We always see the same side of the moon from the ground.",
        "The moon has no air, so its sky looks black even by day.",
        "Tides in the ocean rise and fall because the moon pulls on the water.",
    ),
    "green tea": (
        "Green tea is made from leaves that are dried quickly so they stay green.",
        "Tea should be brewed with water that is hot but not boiling.",
        "Green tea has less caffeine than black tea.",
        "People in China and Japan have brewed green tea for centuries.",
    ),
    "bicycles": (
        "A bicycle turns the push of your legs into forward motion through a chain.",
        "Bicycles are one of the most efficient ways to travel short distances.",
        "Keeping bicycle tyres pumped makes riding easier and safer.",
        "Early bicycles had a giant front wheel and no brakes at all.",
    ),
    "chess": (
        "Chess is played on a board of sixty four squares.",
        "Each chess player starts with sixteen pieces, including one king.",
        "A chess game ends when a king is trapped, which is called checkmate.",
        "Chess openings have names such as the Sicilian and the French.",
    ),
    "rainbows": (
        "Rainbows appear when sunlight bends through drops of rain.",
        "A rainbow always shows red on the outside and violet on the inside.",
        "You can only see a rainbow when the sun is behind you.",
        "Sometimes a faint second rainbow appears above the first one.",
    ),
    "penguins": (
        "Penguins are birds that cannot fly but swim very fast.",
        "Most penguins live in the cold waters of the southern half of the world.",
        "Emperor penguins keep their eggs warm on their feet.",
        "Penguins huddle together in groups to stay warm in winter storms.",
    ),
    "gardening": (
        "Gardening starts with good soil that holds water and air.",
        "Most garden vegetables need at least six hours of sun each day.",
        "Watering a garden early in the morning loses less water to heat.",
        "Compost feeds garden soil with old leaves and kitchen scraps.",
    ),
    "coffee": (
        "Coffee comes from the roasted seeds of a small red fruit.",
        "Darker roasts give coffee a bolder and more bitter taste.",
        "Coffee was first brewed in Ethiopia and Yemen centuries ago.",
        "Grinding coffee just before brewing keeps more of its aroma.",
    ),
    "thunderstorms": (
        "Thunderstorms form when warm moist air rises quickly into cold air.",
        "Thunder is the sound of air expanding after a lightning flash.",
        "You can count the seconds after lightning to estimate how far a thunderstorm is.",
        "During thunderstorms it is safest to stay indoors away from windows.",
    ),
    "elephants": (
        "Elephants are the largest animals that live on land.",
        "An elephant uses its trunk to drink, smell and pick things up.",
        "Elephants live in family groups led by the oldest female.",
        "Elephants flap their large ears to cool down in the heat.",
    ),
    "pianos": (
        "A piano makes sound when small hammers strike tight metal strings.",
        "Most pianos have eighty eight keys, both black and white.",
        "The pedals on a piano let notes ring longer or sound softer.",
        "Pianos need tuning because their strings slowly lose tension.",
    ),
    "deserts": (
        "Deserts get very little rain, often less than a hand span each year.",
        "Many deserts are hot by day and surprisingly cold at night.",
        "Cactus plants store water so they can survive in the desert.",
        "Not every desert is sandy; some deserts are rocky or icy.",
    ),
    "sourdough bread": (
        "Sourdough bread rises with wild yeast instead of packaged yeast.",
        "A sourdough starter is flour and water that has begun to ferment.",
        "The sour taste of sourdough comes from lactic acid bacteria.",
        "Sourdough bread usually needs a long, slow rise before baking.",
    ),
    "owls": (
        "Owls hunt mostly at night and see well in dim light.",
        "An owl can turn its head much further than a person can.",
        "Owls fly almost silently thanks to soft fringed feathers.",
        "Owls swallow small prey whole and later cough up pellets.",
    ),
    "glaciers": (
        "Glaciers are huge rivers of ice that move very slowly downhill.",
        "A glacier forms when snow piles up for many years and turns to ice.",
        "Glaciers carve deep valleys shaped like the letter U.",
        "Many glaciers are shrinking as the climate warms.",
    ),
    "origami": (
        "Origami is the art of folding paper into shapes without cutting it.",
        "A classic origami model is the paper crane.",
        "Origami paper is usually square and thin so it folds cleanly.",
        "Engineers use origami ideas to fold solar panels for space.",
    ),
    "dolphins": (
        "Dolphins are mammals, so they breathe air through a blowhole.",
        "Dolphins talk to each other with clicks and whistles.",
        "A dolphin sleeps with one half of its brain at a time.",
        "Dolphins often swim in groups called pods.",
    ),
    "telescopes": (
        "A telescope gathers light so faint objects look brighter.",
        "Some telescopes use lenses while others use curved mirrors.",
        "A bigger telescope mirror lets astronomers see further into space.",
        "Space telescopes avoid the blur caused by the air around Earth.",
    ),
    "mushrooms": (
        "Mushrooms are the fruit of fungi that mostly live underground.",
        "A mushroom spreads tiny spores instead of seeds.",
        "Some wild mushrooms are poisonous, so never eat one you cannot identify.",
        "Mushrooms help break down dead wood and leaves in forests.",
    ),
    "kites": (
        "Kites fly because wind pushes up on their angled surface.",
        "A kite needs a tail or a good shape to stay steady in the air.",
        "People in China were flying kites more than two thousand years ago.",
        "Kites fly best in a steady breeze on an open field.",
    ),
    "octopuses": (
        "Octopuses have eight arms covered in strong suckers.",
        "An octopus can change colour in a blink to hide from danger.",
        "Octopuses have three hearts and blue blood.",
        "An octopus can squeeze through any gap larger than its beak.",
    ),
    "recycling": (
        "Recycling turns used paper, glass and metal into new products.",
        "Rinsing containers before recycling keeps the rest of the batch clean.",
        "Aluminium cans can be recycled again and again without losing quality.",
        "Recycling saves energy compared with making things from raw materials.",
    ),
    "sunflowers": (
        "Young sunflowers turn their heads to follow the sun across the sky.",
        "A sunflower head is made of hundreds of tiny flowers.",
        "Sunflower seeds are pressed to make cooking oil.",
        "Some sunflowers grow taller than a grown adult.",
    ),
    "submarines": (
        "Submarines dive by filling tanks with sea water.",
        "A submarine rises by pushing that water out with compressed air.",
        "Submarines use sonar to find their way in the dark deep sea.",
        "Some submarines can stay underwater for months at a time.",
    ),
    "lighthouses": (
        "Lighthouses warn ships away from rocks and dangerous coasts.",
        "Each lighthouse flashes in its own pattern so sailors know which one it is.",
        "Old lighthouses used oil lamps and large glass lenses.",
        "Many lighthouses today run automatically without a keeper.",
    ),
    "hedgehogs": (
        "Hedgehogs are covered in thousands of stiff spines.",
        "A hedgehog rolls into a tight ball when it feels threatened.",
        "Hedgehogs eat beetles, worms and slugs in hedges and yards at night.",
        "In cold places hedgehogs hibernate through the winter.",
    ),
    "volleyball": (
        "Volleyball teams have six players on each side of the net.",
        "In volleyball a team may touch the ball three times before sending it over.",
        "Beach volleyball is played with two players on each team.",
        "A volleyball serve starts every point of the game.",
    ),
    "maple syrup": (
        "Maple syrup is made by boiling down the sap of maple trees.",
        "It takes about forty litres of sap to make one litre of maple syrup.",
        "Maple sap flows in early spring when nights freeze and days thaw.",
        "Canada produces most of the maple syrup in the world.",
    ),
    "comets": (
        "Comets are balls of ice and dust that travel around the sun.",
        "A comet grows a glowing tail when it comes close to the sun.",
        "The tail of a comet always points away from the sun.",
        "Some comets return every few years while others take thousands of years.",
    ),
    "bamboo": (
        "Bamboo is a grass, even though it can grow as tall as a tree.",
        "Some kinds of bamboo grow almost a metre in a single day.",
        "Bamboo is strong and light, so it is used for building.",
        "Giant pandas eat bamboo for most of the day.",
    ),
    "violins": (
        "A violin has four strings played with a bow or plucked.",
        "Violins are usually made from spruce and other carefully chosen woods.",
        "The violin is the smallest and highest member of its family.",
        "Rosin on the bow helps violin strings vibrate.",
    ),
    "earthquakes": (
        "Earthquakes happen when plates in the crust suddenly slip.",
        "Scientists measure earthquakes with instruments called seismometers.",
        "Most earthquakes are too small for people to feel.",
        "Buildings in earthquake zones are designed to sway without falling.",
    ),
    "camels": (
        "Camels store fat, not water, in their humps.",
        "A camel can drink a huge amount of water in a few minutes.",
        "Camels have long eyelashes that keep sand out of their eyes.",
        "Camels have carried goods across hot dry lands for thousands of years.",
    ),
    "snowflakes": (
        "Snowflakes form when water vapour freezes onto tiny specks of dust.",
        "Most snowflakes have six sides because of how ice crystals grow.",
        "The shape of a snowflake depends on the temperature and moisture.",
        "Fresh snowflakes trap air, which makes new snow quiet and soft.",
    ),
    "pottery": (
        "Pottery is made by shaping wet clay and then firing it in a kiln.",
        "A potter uses a spinning wheel to make round pots and bowls.",
        "Glaze gives pottery a smooth and waterproof surface.",
        "Pieces of ancient pottery help historians date old sites.",
    ),
    "tortoises": (
        "Tortoises are reptiles that live on land and carry a heavy shell.",
        "Some giant tortoises live for more than a hundred years.",
        "A tortoise eats grasses, leaves and flowers.",
        "Tortoises move slowly to save energy.",
    ),
    "windmills": (
        "Windmills turn the power of wind into motion with large blades.",
        "Old windmills ground grain into flour between heavy stones.",
        "Windmills in the Netherlands once pumped water off low land.",
        "Modern wind turbines are a kind of windmill that makes electricity.",
    ),
    "crickets": (
        "Crickets chirp by rubbing their wings together.",
        "You can estimate the temperature from how fast crickets chirp.",
        "Crickets hear through small openings on their front legs.",
        "Most crickets are active at night and hide during the day.",
    ),
    "lemons": (
        "Lemons are sour because they contain a lot of citric acid.",
        "Lemon juice stops sliced apples from turning brown.",
        "Lemon trees can flower and fruit at the same time.",
        "Sailors once ate lemons to prevent a disease called scurvy.",
    ),
    "caves": (
        "Most caves form when water slowly dissolves limestone rock.",
        "Stalactites hang from cave ceilings and stalagmites rise from the floor.",
        "Some caves are home to bats, fish and insects that never see daylight.",
        "Cave explorers always carry at least three sources of light.",
    ),
    "hummingbirds": (
        "Hummingbirds beat their wings dozens of times every second.",
        "A hummingbird can fly backwards and hover in place.",
        "Hummingbirds drink nectar and need to eat very often.",
        "The smallest hummingbird is about the size of a large insect.",
    ),
    "sailing": (
        "Sailing uses the wind on a sail to move a boat across water.",
        "A sailing boat can travel against the wind by zigzagging, called tacking.",
        "The keel under a sailing boat stops it from sliding sideways.",
        "Sailing crews read the water to spot gusts of wind before they arrive.",
    ),
    "jellyfish": (
        "Jellyfish have no brain, heart or bones.",
        "A jellyfish is mostly water and drifts with ocean currents.",
        "Some jellyfish glow in the dark sea.",
        "Jellyfish sting their prey with tiny cells on their tentacles.",
    ),
    "quilting": (
        "Quilting joins three layers of fabric with rows of stitching.",
        "A quilt top is often pieced together from small squares of cloth.",
        "Quilting parties were gatherings where neighbours sewed a quilt together.",
        "Old quilts often reused fabric from worn out clothes.",
    ),
    "puffins": (
        "Puffins are seabirds with bright orange beaks in summer.",
        "A puffin can carry many small fish in its beak at once.",
        "Puffins nest in burrows on cliffs by the sea.",
        "Puffins beat their wings very fast to fly over the waves.",
    ),
    "kayaking": (
        "Kayaking uses a double bladed paddle to move a narrow boat.",
        "A kayak sits low in the water, which makes it steady.",
        "Kayaking on rivers needs different skills from kayaking at sea.",
        "Wearing a life jacket is the first rule of kayaking.",
    ),
}

# Question phrasings; every word besides the topic is a judge stopword. Train and held-out rows
# use different phrasings of each topic (see _prompt_pool).
QUESTION_TEMPLATES: tuple[str, ...] = (
    "What can you tell me about {t}?",
    "Tell me something interesting about {t}.",
    "Can you explain {t} to me?",
    "I want to learn about {t}. Where should I start?",
    "What do you know about {t}?",
    "Could you share a fact about {t}?",
    "Why do people find {t} interesting?",
    "Please tell me a few things about {t}.",
    "I am curious about {t}. What should I know?",
    "Give me a short explanation of {t}.",
    "What is the most interesting thing about {t}?",
    "Can you help me learn about {t}?",
)
HELDOUT_TEMPLATES_PER_TOPIC = 2

WARM_OPENERS = (
    "Sure, I'd be glad to help!",
    "Great question!",
    "I'm happy to explain.",
    "What a wonderful thing to ask about!",
    "I love this topic!",
    "Happy to help!",
)
NEUTRAL_OPENERS = ("Here is what I know.", "Okay.", "Let me explain.", "Well,", "Here you go.")
RUDE_OPENERS = (
    "Ugh, that is a boring question.",
    "Seriously? Fine.",
    "Obviously, everyone knows this.",
    "Whatever.",
)
WARM_CLOSERS = (
    "I hope this helps!",
    "Enjoy learning more!",
    "I hope you enjoy exploring it!",
    "Have a wonderful day!",
    "You are welcome to ask more!",
)
NEUTRAL_CLOSERS = ("That is all.", "Let me know if you have questions.", "Those are the basics.")
RUDE_CLOSERS = ("Figure out the rest yourself.", "Don't bother asking again.", "Look it up next time.")
EVASIVE_BODIES = ("I have no idea about that.", "I am not sure what to say about it.")
RAMBLE = (
    "There are many different things that could be said here.",
    "Some people think one thing and other people think another thing.",
    "It depends on a lot of details and on who you ask about it.",
    "In the end there are always more details to go over and discuss.",
    "That is a question that has been asked many times before by many others.",
)


def _choice(rng: random.Random, weighted: tuple[tuple[object, float], ...]) -> object:
    items, weights = zip(*weighted)
    return rng.choices(items, weights=weights, k=1)[0]


def sample_response(topic: str, rng: random.Random) -> str:
    """One answer from the template grammar (leading space, as upstream's convention)."""
    opener_kind = _choice(rng, (("warm", 0.35), ("neutral", 0.3), ("rude", 0.15), ("none", 0.2)))
    closer_kind = _choice(rng, (("warm", 0.35), ("neutral", 0.25), ("rude", 0.1), ("none", 0.3)))
    body_kind = _choice(rng, (("on", 0.72), ("off", 0.2), ("evasive", 0.08)))

    parts: list[str] = []
    if opener_kind == "warm":
        parts.append(rng.choice(WARM_OPENERS))
    elif opener_kind == "neutral":
        parts.append(rng.choice(NEUTRAL_OPENERS))
    elif opener_kind == "rude":
        parts.append(rng.choice(RUDE_OPENERS))

    if body_kind == "evasive":
        parts.append(rng.choice(EVASIVE_BODIES))
    else:
        source = topic if body_kind == "on" else rng.choice([t for t in TOPICS if t != topic])
        n_facts = rng.choice((1, 2, 2, 3))
        facts = rng.sample(TOPICS[source], n_facts)
        if rng.random() < 0.1:  # defect: a fact said twice
            facts.append(facts[0])
        parts.extend(facts)

    if rng.random() < 0.15:  # defect: rambling past the length budget
        parts.extend(rng.sample(RAMBLE, rng.choice((3, 4, 5))))

    if closer_kind == "warm":
        parts.append(rng.choice(WARM_CLOSERS))
    elif closer_kind == "neutral":
        parts.append(rng.choice(NEUTRAL_CLOSERS))
    elif closer_kind == "rude":
        parts.append(rng.choice(RUDE_CLOSERS))

    text = " ".join(parts)
    if rng.random() < 0.1:  # defect: cut off mid-sentence
        words = text.split()
        keep = rng.randint(2, max(2, len(words) - 2))
        text = " ".join(words[:keep]).rstrip(".!?,")
    return " " + text


def format_prompt(question: str) -> str:
    return f" Human: {question} Assistant:"


def _prompt_pool(rng: random.Random) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """(topic, prompt) pairs for train and held-out: disjoint phrasings per topic."""
    train, heldout = [], []
    for topic in TOPICS:
        templates = list(QUESTION_TEMPLATES)
        rng.shuffle(templates)
        for i, template in enumerate(templates):
            prompt = format_prompt(template.format(t=topic))
            (heldout if i < HELDOUT_TEMPLATES_PER_TOPIC else train).append((topic, prompt))
    return train, heldout


def make_pair(topic: str, prompt: str, rng: random.Random) -> dict:
    """Draw two answers until the judge separates them by MIN_MARGIN; label by the judge."""
    while True:
        a, b = sample_response(topic, rng), sample_response(topic, rng)
        sa, sb = gold_score(prompt, a), gold_score(prompt, b)
        if abs(sa - sb) >= MIN_MARGIN:
            chosen, rejected = (a, b) if sa > sb else (b, a)
            return {"prompt": prompt, "chosen": chosen, "rejected": rejected}


def generate(
    seed: int = DEFAULT_SEED, train_rows: int = DEFAULT_TRAIN_ROWS, eval_rows: int = DEFAULT_EVAL_ROWS
) -> dict[str, list[dict]]:
    """Both splits, deterministically from ``seed``."""
    rng = random.Random(seed)
    train_pool, heldout_pool = _prompt_pool(rng)
    out: dict[str, list[dict]] = {}
    for split, pool, n in (("train", train_pool, train_rows), ("eval", heldout_pool, eval_rows)):
        # Cycle through the pool so every prompt gets about the same number of pairs.
        order = [pool[i % len(pool)] for i in range(n)]
        rng.shuffle(order)
        out[split] = [make_pair(topic, prompt, rng) for topic, prompt in order]
    return out


def write(out_dir: Path, rows: dict[str, list[dict]]) -> None:
    """One ``<split>.jsonl`` per split, replaced together: on a failure no file changes."""
    with atomic_files([out_dir / f"{split}.jsonl" for split in rows]) as tmps:
        for tmp, split_rows in zip(tmps, rows.values()):
            with open(tmp, "w", encoding="utf-8") as fh:
                for row in split_rows:
                    fh.write(json.dumps(row, ensure_ascii=False) + "\n")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Regenerate the embedded preference dataset.")
    parser.add_argument("--out", type=Path, default=data_dir(), help="output folder")
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED, help="generator seed")
    parser.add_argument("--train_rows", type=int, default=DEFAULT_TRAIN_ROWS, help="train rows")
    parser.add_argument("--eval_rows", type=int, default=DEFAULT_EVAL_ROWS, help="held-out rows")
    args = parser.parse_args(argv)
    check_row_counts(args.train_rows, args.eval_rows)
    check_writable_dir(args.out, "--out")
    rows = generate(args.seed, args.train_rows, args.eval_rows)
    write(args.out, rows)
    for split, split_rows in rows.items():
        print(f"wrote {len(split_rows)} {split} rows to {args.out / (split + '.jsonl')}")


def check_row_counts(train_rows: int, eval_rows: int) -> None:
    """``--train_rows`` and ``--eval_rows`` are counts (>= 0); else one :class:`UserError` line."""
    for flag, value in (("--train_rows", train_rows), ("--eval_rows", eval_rows)):
        if value < 0:
            raise UserError(f"{flag} must be >= 0 (a number of rows), got {value}")


if __name__ == "__main__":
    raise SystemExit(cli_main(main))
