"""The plain data passed between the pipeline's stages.

graph -> strategies -> costs -> problem -> plan: each module here holds one stage's output
type (and the placement notation they all share). They import no stage: the algorithms that
build and read them import these modules, never the reverse.
"""
