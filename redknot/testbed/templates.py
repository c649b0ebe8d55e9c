"""The corpus's vocabulary: name syllables, entity kinds, sentence templates per document kind and
relation, the questions each cluster type asks, and filler. ``world``, ``documents``, ``clusters``
and ``easy`` build names, documents and questions from these; ``_TEMPLATE_WORDS`` is every word a
template contains, which generated names avoid.
"""

import re

from ..qa.answers import DESCRIPTIONS, EASY_FACTS  # noqa: F401  (the relation phrasings answers restate)

# ---- names --------------------------------------------------------------------------------------
ONSETS = ["b", "br", "c", "d", "dr", "f", "g", "gr", "h", "k", "kr", "l", "m", "n", "p", "r", "s", "st", "t",
          "th", "tr", "v", "w", "z", "sh", "bl"]
INNER_ONSETS = ["b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z"]  # later syllables
VOWELS = ["a", "e", "i", "o", "u", "a", "e", "o", "a", "e", "i", "o", "ai", "ei", "y"]
CODAS = ["n", "r", "l", "s", "m", "th", "nd", "v", "x", "ll", "rn", "sk", "k"]
SURNAME_SUFFIXES = ["", "", "", "sen", "ner", "by", "ard", "ell", "ov", "mont", "ack"]
CITY_SUFFIXES = ["mere", "holm", "ford", "wick", "stead", "bury", "port", "dale", "vik", "haven", "gard",
                 "ton", "moor", "ness", "field", "", ""]
COMPANY_KINDS = {  # kind word -> plural products
    "Works": ["steel bridges", "iron gates", "railway wagons"],
    "Mills": ["wool blankets", "linen sheets", "cotton sails"],
    "Labs": ["medical sensors", "water filters", "weather instruments"],
    "Foundry": ["church bells", "bronze statues", "cast iron stoves"],
    "Shipping": ["river barges", "cargo boats", "ferry engines"],
    "Instruments": ["violins", "pianos", "brass horns"],
    "Press": ["maps and atlases", "school books", "playing cards"],
    "Glassworks": ["lenses", "bottles", "stained windows"],
}
ACADEMY_KINDS = ["Academy", "College", "Institute"]
ACADEMY_SUBJECTS = ["music", "engineering", "medicine", "law", "navigation", "painting", "agriculture"]
OCCUPATIONS = ["engineer", "accountant", "designer", "chemist", "clerk", "surveyor", "architect", "translator",
               "machinist", "pilot", "draughtsman", "bookbinder", "electrician", "inspector"]
TOWN_ADJECTIVES = ["small", "quiet", "busy", "old", "hilly", "windy", "prosperous"]
ORDINALS = ["second", "third", "fourth", "fifth", "last"]
PRONOUNS = {"she": dict(pron="she", Pron="She", obj="her", poss="her", Poss="Her", person="woman"),
            "he": dict(pron="he", Pron="He", obj="him", poss="his", Poss="His", person="man")}

# ---- templates ----------------------------------------------------------------------------------
# Placeholders: {name} full name; {N}/{n} subject at a sentence start / inside (name or pronoun);
# {C}/{c} the same for companies, towns and academies; {year} a filler year (never an answer);
# {num}, {num2}, {ordinal} small numbers; {desc}/{Desc}/{dposs} the described person of a description cluster.
PERSON_INTRO = ["{name} is {a_occupation}.", "{name} is {a_occupation} with a long career behind {obj}.",
                "{name} is {a_occupation} known well beyond {poss} own field."]
PERSON_FACTS = {
    "birth": ["{N} was born in {birth_city} in {birth_year}.",
              "{N} was born in {birth_year} in the town of {birth_city}.",
              "{Poss} birthplace is {birth_city}, where {pron} was born in {birth_year}."],
    "employer": ["{N} works at {employer}.", "{N} has been employed by {employer} since {year}.",
                 "{N} joined {employer} in {year} and still works there.",
                 "For many years {n} has worked for {employer}."],
    "school": ["{N} studied at {school}.", "As a student, {n} attended {school}.",
               "{N} trained at {school} before starting work."],
    "residence": ["{N} now lives in {residence}.", "Today {n} lives in {residence}.",
                  "{N} has lived in {residence} for many years."],
}
COMPANY_INTRO = ["{name} is a company that makes {product}.", "{name} is a maker of {product}.",
                 "{name} produces {product} and sells them across the region."]
COMPANY_FACTS = {
    "founding": ["{C} was founded in {founded_year} by {founder}.", "{founder} founded {c} in {founded_year}.",
                 "The company was founded by {founder} in {founded_year}."],
    "hq": ["{C} is headquartered in {hq}.", "The headquarters of {c} are in {hq}.",
           "{C} has its headquarters in {hq}."],
    "engineer": ["The chief engineer of {c} is {engineer}.", "{engineer} serves as the chief engineer of {c}.",
                 "Its chief engineer is {engineer}."],
}
CITY_INTRO = ["{name} is {a_adj} town of about {population} thousand people.",
              "{name} is {a_adj} town with a weekly market.",
              "{name} is {a_adj} town known for its narrow streets."]
CITY_FACTS = {
    "river": ["{C} lies on the {river}.", "The {river} flows through {c}.",
              "{C} was built on both banks of the {river}."],
    "mountain": ["{mountain} rises to the north of {c}.", "{C} sits at the foot of {mountain}."],
    "founding": ["{C} was founded in {founded_year}.", "The town was founded in {founded_year}.",
                 "{C} dates from {founded_year}, when it was founded by fishing families."],
    "mayor": ["The mayor of {c} is {mayor}.", "{mayor} has been the mayor of {c} since {year}.",
              "{C} is governed by its mayor, {mayor}."],
}
ACADEMY_INTRO = ["{name} is a school of {subject} in {city}.", "{name} teaches {subject} in the town of {city}."]
ACADEMY_FACTS = {"founding": ["{C} was founded in {founded_year}.", "The academy was founded in {founded_year}."]}

ROLE_FACTS = {  # description's document A: X's bio states the role, X first (the order of every bio fact)
    "founder": ["{N} founded {holder} in {founded_year}.", "In {founded_year} {n} founded {holder}.",
                "{N} is the founder of {holder}."],
    "mayor": ["{N} is the mayor of {holder}.", "{N} has been the mayor of {holder} since {year}.",
              "{N} was elected mayor of {holder} in {year}."],
    "engineer": ["{N} is the chief engineer of {holder}.", "{N} serves as the chief engineer of {holder}.",
                 "{N} has been the chief engineer of {holder} since {year}."],
}
LATER_FACTS = {  # sentence in document B (whose subject is the answer's entity)
    "final_years": ["{Desc} spent {dposs} final years in {name}.",
                    "Among the town's best-known residents was {desc}, who spent {dposs} final years here.",
                    "In old age {desc} settled in {name} and spent {dposs} final years in a house near the market."],
    "statue": ["A bronze statue of {desc} stands in the main square of {name}.",
               "In the main square of {name} stands a statue of {desc}.",
               "The town put up a statue of {desc} in its main square."],
    "honorary": ["In {hon_year} the academy awarded an honorary degree to {desc}.",
                 "{Desc} received an honorary degree from {name} in {hon_year}.",
                 "Among those given an honorary degree by {name} was {desc}, in {hon_year}."],
    "married": ["{N} married {desc} in {year}.", "In {year} {n} married {desc}."],
}

# cross_doc: the continuation of a bio. No name anywhere: the subject is the previous document's.
CONTINUATION_TITLES = ["Later life", "Later years", "Last years", "Honours and family", "After retirement",
                       "The later years"]
CONTINUATION_INTRO = ["{Pron} remained active long after {poss} working years.",
                      "{Poss} later life was quieter, though never idle.",
                      "In {poss} later years {pron} travelled less and wrote more letters."]
CONTINUATION_FACTS = {  # subject by pronoun only
    "final_years": ["{Pron} spent {poss} final years in {town}.",
                    "In old age {pron} settled in {town} and spent {poss} final years in a house near the market."],
    "statue": ["A bronze statue of {obj} stands in the main square of {town}.",
               "In the main square of {town} stands a statue of {obj}."],
    "honorary": ["In {hon_year} {pron} received an honorary degree from {academy}.",
                 "{Pron} was given an honorary degree by {academy} in {hon_year}."],
    "married": ["In {year} {pron} married {spouse}.", "{Pron} married {spouse} in {year}."],
}

FILLER = {
    "person": [
        "{N} is known among colleagues for careful work and a dry sense of humour.",
        "In {year} {n} spent a long summer travelling by train across the northern provinces.",
        "Friends describe {obj} as patient, stubborn and generous with {poss} time.",
        "{N} keeps a small garden and grows beans, onions and far too many tomatoes.",
        "{Poss} first job was sweeping the floor of a print shop, which paid almost nothing.",
        "{N} once said that the best ideas arrive on long walks rather than at a desk.",
        "In {year} {n} entered a chess tournament and finished in {ordinal} place.",
        "{N} speaks three languages and reads a fourth, mostly with the help of a dictionary.",
        "{Poss} letters from those years are kept in a box of {num} bundles tied with string.",
        "Colleagues remember a long night in {year} when {n} fixed a broken boiler by lamplight.",
        "{N} rarely gives interviews and prefers to let the work speak for itself.",
        "On weekends {n} plays the cello in an amateur orchestra of about {num} musicians.",
        "{N} has written a handful of short essays on repair, patience and old tools.",
        "As a child {n} collected stones, stamps and the timetables of local ferries.",
        "{N} likes to cook for large groups and is famous for a thick winter soup.",
        "In {year} {n} broke an arm while climbing a ladder and spent six weeks reading.",
        "{Poss} desk is covered with notebooks, each one filled with lists and small sketches.",
        "{N} swims in cold water every morning, whatever the season.",
        "Neighbours say {n} is the first to help when a roof leaks or a fence falls down.",
        "{N} has kept a diary every day since {year}, with very few gaps.",
    ],
    "company": [
        "{C} employs about {num} people across {num2} workshops.",
        "In {year} {c} opened a second workshop and doubled its output within a few years.",
        "Its products are sold in shops across the region and shipped abroad by rail.",
        "The early account books of {c} survive and show a loss in almost every month of the first year.",
        "A fire in {year} destroyed part of the main hall, but no one was hurt.",
        "Apprentices at {c} spend their first year learning to sharpen and care for their tools.",
        "{C} publishes a short report every spring listing new designs and retired ones.",
        "In {year} the company won a large order that kept every workshop busy for two years.",
        "Workers take their lunch together in a long room above the loading yard.",
        "The firm has a reputation for slow deliveries and products that rarely break.",
        "In {year} a strike lasted {num} days and ended with shorter working hours.",
        "{C} keeps a small museum of old models, open to visitors on the first Sunday of each month.",
        "Customers often write to ask for spare parts for items that are decades old.",
        "The company sign, a plain circle crossed by two lines, has not changed in a long time.",
        "During a hard winter in {year} {c} kept paying wages even though the workshops stood still.",
        "Its catalogue lists more than {num} items, from small parts to complete machines.",
        "The company still uses a hand bell to mark the start and end of each shift.",
        "Several former apprentices later started small workshops of their own.",
    ],
    "city": [
        "The old market square is lined with narrow houses painted in pale colours.",
        "Every autumn {c} holds a fair that lasts {num} days and draws visitors from far away.",
        "A stone bridge built in {year} still carries traffic over the harbour canal.",
        "The town library holds about {num} thousand books and a collection of old maps.",
        "In {year} a great storm tore the roofs off many houses near the harbour.",
        "Local bakers are known for a dark rye bread flavoured with caraway.",
        "The railway reached {c} in {year}, and the station is still in use.",
        "Most streets in the old centre are closed to cars on market days.",
        "The town hall clock has been running slow for as long as anyone can remember.",
        "In winter the lanes are cleared by volunteers who meet at dawn with shovels.",
        "A small museum near the station tells the story of local crafts and trades.",
        "Summer concerts take place in the park behind the old hospital.",
        "Fishermen still sell their catch at the quay early every morning.",
        "The local football club was formed in {year} and has never won a league title.",
        "Visitors often remark on the smell of wood smoke that hangs over {c} in autumn.",
        "A row of lime trees planted in {year} shades the main street in summer.",
        "The school of {c} occupies a former wool warehouse.",
        "Three buses a day connect {c} with the villages further up the valley.",
    ],
    "academy": [
        "{C} admits about {num} students each year.",
        "Its library is open day and night during the examination weeks.",
        "In {year} the academy added a new wing for laboratories.",
        "Students wear a plain grey scarf on formal occasions.",
        "Lectures are held in a hall with {num} wooden benches and no heating.",
        "{C} runs a summer course for teachers from smaller schools.",
        "A long rivalry with a neighbouring school is settled each spring by a rowing race.",
        "In {year} the academy nearly closed for lack of funds, but local families raised the money.",
        "Its motto, carved above the main door, is rarely translated the same way twice.",
        "Many graduates return years later to teach a course or two.",
        "The garden of {c} is famous for its old pear trees.",
        "Every year the academy prints a thin book of student poems.",
    ],
    "generic": [
        "Much of what is known about those years comes from letters and local newspapers.",
        "Accounts differ on the details, but most agree on the main events.",
        "Historians have written about this period at length, though rarely in agreement.",
        "A short film about it was shown on regional television in {year}.",
        "Old photographs from the time show muddy streets, horses and crowded windows.",
        "The archive holds {num} boxes of papers that have never been fully catalogued.",
        "Few written records survive from the earliest period.",
        "The story is often retold, and each telling adds a little more colour.",
        "A local society meets once a month to collect recollections and old documents.",
        "In {year} a small exhibition brought many of these items together for the first time.",
        "Some of the surviving drawings are now too faded to read.",
        "A guidebook printed in {year} devotes two full pages to the subject.",
        "Schoolchildren in the region still learn a simple version of this history.",
        "Several details remain uncertain, and new letters turn up from time to time.",
    ],
}

# Questions: single-hop relations (also used by easy_records), multi-hop and cross-doc variants.
SINGLE_HOP = {  # relation -> (entity kind, attribute, questions)
    "birth_city": ("person", "birth_city", ["Which city was {X} born in?", "In which city was {X} born?",
                                            "Where was {X} born?"]),
    "birth_year": ("person", "birth_year", ["In which year was {X} born?", "When was {X} born?"]),
    "employer": ("person", "employer", ["Which company does {X} work for?", "Who employs {X}?"]),
    "school": ("person", "school", ["Where did {X} study?", "Which school did {X} attend?"]),
    "residence": ("person", "residence", ["Where does {X} live today?", "In which city does {X} live?"]),
    "company_founded": ("company", "founded_year", ["In which year was {X} founded?", "When was {X} founded?"]),
    "founder": ("company", "founder", ["Who founded {X}?", "Who is the founder of {X}?"]),
    "hq": ("company", "hq", ["Where is {X} headquartered?", "In which city is {X} headquartered?"]),
    "engineer": ("company", "engineer", ["Who is the chief engineer of {X}?"]),
    "river": ("city", "river", ["Which river flows through {X}?", "On which river does {X} lie?"]),
    "mayor": ("city", "mayor", ["Who is the mayor of {X}?", "Who governs {X} as mayor?"]),
    "town_founded": ("city", "founded_year", ["In which year was {X} founded?", "When was {X} founded?"]),
    "mountain": ("city", "mountain", ["Which mountain rises near {X}?"]),
}
MULTI_HOP = {  # (person attribute -> bridge kind, bridge attribute) -> questions
    ("employer", "hq"): ["In which city is the company that {X} works for headquartered?",
                         "Where is the company that employs {X} headquartered?"],
    ("employer", "founded_year"): ["In which year was the company that {X} works for founded?",
                                   "When was {X}'s employer founded?"],
    ("employer", "founder"): ["Who founded the company that {X} works for?", "Who is the founder of {X}'s employer?"],
    ("birth_city", "river"): ["Which river flows through the city where {X} was born?",
                              "On which river does {X}'s birthplace lie?"],
    ("birth_city", "mayor"): ["Who is the mayor of the city where {X} was born?",
                              "Who is the mayor of {X}'s birthplace?"],
    ("birth_city", "founded_year"): ["In which year was the city where {X} was born founded?"],
    ("residence", "river"): ["Which river flows through the city where {X} lives?"],
    ("school", "founded_year"): ["In which year was the school where {X} studied founded?"],
    ("school", "city"): ["In which city is the school where {X} studied?"],
}
CROSS_DOC_QUESTIONS = {
    "final_years": ["In which city did {X} spend {xposs} final years?", "Where did {X} spend {xposs} final years?"],
    "statue": ["In which city does a statue of {X} stand?", "Where does a statue of {X} stand?"],
    "honorary": ["In which year did {X} receive an honorary degree?", "When did {X} receive an honorary degree?"],
    "married": ["Whom did {X} marry?", "Who did {X} marry?"],
}
VARIANTS = {
    "single_hop": list(SINGLE_HOP),
    "multi_hop": [f"{a}->{b}" for a, b in MULTI_HOP],
    "cross_doc": list(CONTINUATION_FACTS),
    "description": [f"{d}->{l}" for d in DESCRIPTIONS for l in LATER_FACTS],
    "role": list(DESCRIPTIONS),
}
VARIANTS["mention"] = VARIANTS["description"]  # the same roles and facts; only document A differs


def _template_words() -> set[str]:
    texts = [t for d in (PERSON_FACTS, COMPANY_FACTS, CITY_FACTS, ACADEMY_FACTS, LATER_FACTS, FILLER, DESCRIPTIONS,
                         CROSS_DOC_QUESTIONS, CONTINUATION_FACTS, ROLE_FACTS) for v in d.values() for t in v]
    texts += PERSON_INTRO + COMPANY_INTRO + CITY_INTRO + ACADEMY_INTRO + list(EASY_FACTS.values())
    texts += CONTINUATION_TITLES + CONTINUATION_INTRO
    texts += [q for _, _, qs in SINGLE_HOP.values() for q in qs] + [q for qs in MULTI_HOP.values() for q in qs]
    texts += OCCUPATIONS + TOWN_ADJECTIVES + ACADEMY_SUBJECTS + [p for ps in COMPANY_KINDS.values() for p in ps]
    return {w.lower() for t in texts for w in re.findall(r"[A-Za-z]+", t)}


_TEMPLATE_WORDS = _template_words()
