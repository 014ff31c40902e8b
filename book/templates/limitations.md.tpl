# The discussion's limits of each run (book/generated/limitations.md), filled by `wavesurf reproduce`
# from each model's executed pages, like answer.md.tpl: a line "<notebook stem>: <text>" is used when
# that notebook ran for the model, and [[key]] or [[key:format]] glues that notebook's value `key`.
# Lines starting with "#" are comments.
06_speed_table: [[limitations]]
