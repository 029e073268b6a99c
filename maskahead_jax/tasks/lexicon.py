"""The closed lexicon of the synthetic task suite (all lower case, no digits).

Every word that any generator emits is listed here, so the word-level tokenizer built from it
(`maskahead_jax.tasks.tokenizer`) never needs its character fallback on task text.
"""
from __future__ import annotations

NOUNS = """river mountain forest garden village tower bridge market harbor valley island castle
library school kitchen window engine machine letter story song picture table chair lamp door road
field meadow lake ocean cloud storm winter summer morning evening night farmer teacher doctor
sailor painter singer merchant soldier child stranger traveler friend neighbor captain baker
hunter miner weaver potter clock mirror basket lantern candle blanket wagon ship boat train""".split()
ADJS = """quiet bright dark old young small large ancient gentle brave clever calm busy distant
golden silver hidden narrow wide heavy light warm cold strange simple proud tired happy sad
careful curious honest noble rapid slow steady silent hollow rough smooth early late""".split()
VERBS = """walked waited watched painted carried followed visited opened closed found built
crossed climbed counted noticed remembered described repaired cleaned gathered measured
explored studied praised ignored answered greeted""".split()
VERBS_PRES = """sings sleeps listens rests works travels waits dreams wanders shines grows
falls rises turns""".split()
ADVS = """slowly quickly quietly happily carefully softly suddenly rarely often always
never eagerly gladly calmly""".split()
PLACES = """north south east west upper lower central outer inner old new far""".split()
FIRST = """anna boris clara daniel elena felix greta henry irene jonas karla lukas maria
nikolai olga pavel rosa stefan tara viktor wanda yuri zora adrian bianca cedric delia emil
flora gustav""".split()
LAST = """ostrand velmer kasrik dunmore halvey brantor quillan merrow tessaly corvane
lindqvist ashgrove fenwick marlowe pennick rothwell saxby thornell""".split()
COLORS = """red blue green yellow purple orange white black grey brown violet amber""".split()
ANIMALS = """fox owl wolf bear hawk otter heron lynx badger raven falcon salmon beaver
crane moose""".split()
MATERIALS = """granite marble oak pine brick copper iron glass clay slate cedar bronze""".split()
FUNCTION = """the a an of in on at to from with by for and but or as is was were are be been
it its this that these those there here he she they we you i who which what where when why how
into over under near after before during while about than then so not no yes all each every
some many more most one two three four five six seven eight nine ten first second last next
his her their our my your me him them us do does did has had have will would can could should
must may might very also only just even still again once upon""".split()
# words of the task templates (questions, needles, documents)
TEMPLATE = """pass key special magic number for remember what find hidden text below above
question answer case assigned unit holds code which belongs document located founded founder
built made material known motto called name named list codes stations station order appear
give all following read carefully information story key value recall note important fact
facts record records entity attribute district city town county region hall square founded
year member members owner owned keeps kept stored store number numbers digit digits belongs
belong context end begin start given asked ask please write only said documents""".split()
PUNCT = list(".,:;?!'\"()-")

ALL_WORDS = sorted(set(NOUNS + ADJS + VERBS + VERBS_PRES + ADVS + PLACES + FIRST + LAST + COLORS
                       + ANIMALS + MATERIALS + FUNCTION + TEMPLATE))
