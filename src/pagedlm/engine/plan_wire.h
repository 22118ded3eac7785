// A StepPlan as bytes, for rank 0 to hand the same plan to tensor-parallel ranks in other
// processes (engine/rendezvous.h's channel), with what else decides how a rank runs the step.
#pragma once

#include <string>

#include "pagedlm/sched/step_plan.h"

namespace pagedlm {

struct WireStep {
  StepPlan plan;
  // Rank 0 downloads this step's logits: the runner then runs the step unpadded and eagerly,
  // and every rank must take the same path (the collectives must match).
  bool want_logits = false;
};

std::string encode_step(const StepPlan& plan, bool want_logits);
// Throws when the bytes are not a whole step.
WireStep decode_step(const std::string& bytes);

}  // namespace pagedlm
