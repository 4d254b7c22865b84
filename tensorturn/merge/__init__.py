"""An ensemble made one model: distillation — a student trained on the pool against the vote
(:mod:`tensorturn.merge.distill`, its recipe :mod:`tensorturn.merge.student`) — and soups of
fine-tunes from one start (:mod:`tensorturn.merge.soup`)."""
