"""The flight recorder's evidence: rank records, the gathered dumps, and the verdict. Each
rank's collectives as torch's flight recorder kept them, gathered by the launcher when ranks
disagree, and one pure function (`verdict.decide`) that says where and why they parted. It
may import only the shared top-level modules (stacks, ui) and torch's analyzer, lazily."""
