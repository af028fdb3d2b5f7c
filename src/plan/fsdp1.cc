#include "reshard/plan/fsdp1.h"

#include <algorithm>
#include <cstring>
#include <map>
#include <optional>
#include <set>
#include <unordered_map>

#include "reshard/base/dtype_convert.h"
#include "reshard/base/error.h"

namespace reshard {

namespace {

uint64_t NumelOf(const std::vector<uint64_t>& shape, const std::string& what) {
  uint64_t n = 1;
  for (uint64_t d : shape) n = CheckedMul(n, d, what);
  return n;
}

std::string ParentName(const std::string& name) {
  const auto dot = name.rfind('.');
  return dot == std::string::npos ? std::string() : name.substr(0, dot);
}

bool InSubtree(const std::string& root, const std::string& name) {
  return root.empty() || name == root ||
         (name.size() > root.size() && name.starts_with(root) && name[root.size()] == '.');
}

}  // namespace

const SourceTensor* FindSourceTensor(const Checkpoint& ckpt, const std::string& name,
                                     const std::string& prefix) {
  if (const SourceTensor* t = ckpt.Find(name)) return t;
  if (!prefix.empty()) {
    if (name.starts_with(prefix + ".")) {
      if (const SourceTensor* t = ckpt.Find(name.substr(prefix.size() + 1))) return t;
    }
    if (const SourceTensor* t = ckpt.Find(prefix + "." + name)) return t;
  }
  return nullptr;
}

Fsdp1Plan PlanFsdp1(const Checkpoint& ckpt, const ModelManifest& model, const LayoutSpec& layout) {
  const auto policy = ParseDTypePolicy(layout.dtype);
  if (!policy) Fail(ErrorCode::kInvalidArgument, "unknown dtype policy \"" + layout.dtype + "\"");
  std::optional<DType> param_dtype;
  if (layout.use_orig_params && !layout.param_dtype.empty()) {
    const auto pd = ParseDTypePolicy(layout.param_dtype);
    if (!pd || *pd == DTypePolicy::kKeep) {
      Fail(ErrorCode::kInvalidArgument,
           "--param-dtype " + layout.param_dtype + " is not one of bf16, fp16, fp32");
    }
    param_dtype = StoredDType(DType::kF32, *pd);
  }
  // Every wrap class must name a module class of the model: a typo would otherwise silently
  // give one unit for the whole model.
  std::set<std::string> classes;
  for (const auto& mod : model.modules) classes.insert(mod.cls);
  for (const auto& w : layout.wrap) {
    if (!classes.count(w)) {
      std::string have;
      for (const auto& c : classes) have += (have.empty() ? "" : ", ") + c;
      Fail(ErrorCode::kInvalidArgument, "--wrap " + w + ": the model (" + model.model_class +
                                            ") has no module of that class; its classes: " +
                                            have);
    }
  }
  const std::set<std::string> wrap(layout.wrap.begin(), layout.wrap.end());

  // Each parameter's source tensor.
  std::vector<const SourceTensor*> source(model.params.size(), nullptr);
  for (size_t i = 0; i < model.params.size(); ++i) {
    const ModelParam& p = model.params[i];
    for (const auto& n : p.names) {
      if ((source[i] = FindSourceTensor(ckpt, n, model.base_model_prefix))) break;
    }
    if (!source[i] && p.unsaved) continue;  // the model computes it at load (zeros here)
    if (!source[i]) {
      Fail(ErrorCode::kMismatch, ckpt.dir.string() + ": parameter " + p.names.front() +
                                     " of the model (" + model.model_class +
                                     ") is not in the checkpoint; is the model manifest of "
                                     "another model?");
    }
    if (source[i]->shape != p.shape) {
      std::string a, b;
      for (auto d : p.shape) a += (a.empty() ? "" : ", ") + std::to_string(d);
      for (auto d : source[i]->shape) b += (b.empty() ? "" : ", ") + std::to_string(d);
      Fail(ErrorCode::kMismatch, ckpt.dir.string() + ": tensor " + source[i]->name + " has shape [" +
                                     b + "], the model's parameter " + p.names.front() +
                                     " has [" + a + "]");
    }
  }

  // Children lists (pre-order kept), then the wrapped modules in post-order.
  std::unordered_map<std::string, size_t> index;
  std::vector<std::vector<size_t>> children(model.modules.size());
  for (size_t i = 0; i < model.modules.size(); ++i) {
    index[model.modules[i].name] = i;
    if (i > 0) children[index.at(ParentName(model.modules[i].name))].push_back(i);
  }
  std::vector<size_t> post;
  {
    std::vector<std::pair<size_t, size_t>> stack{{0, 0}};
    while (!stack.empty()) {
      auto& [m, next] = stack.back();
      if (next < children[m].size()) {
        const size_t c = children[m][next++];
        stack.emplace_back(c, 0);
      } else {
        if (m == 0 || wrap.count(model.modules[m].cls)) post.push_back(m);
        stack.pop_back();
      }
    }
  }

  // Each module's unit: the nearest wrapped module at or above it (the root at the top).
  std::vector<size_t> owner(model.modules.size(), 0);
  for (size_t i = 1; i < model.modules.size(); ++i) {
    owner[i] = wrap.count(model.modules[i].cls)
                   ? i
                   : owner[index.at(ParentName(model.modules[i].name))];
  }

  Fsdp1Plan plan;
  std::vector<bool> taken(model.params.size(), false);
  for (size_t u : post) {
    const std::string& unit_name = model.modules[u].name;
    auto flat = std::make_shared<FlatInfo>();
    flat->unit = unit_name;
    std::vector<bool> in_unit(model.params.size(), false);
    std::optional<DType> unit_dtype;
    std::string first_param;
    uint64_t total = 0;
    // The unit's dtype is its checkpoint parameters' (a parameter the model computes at load
    // has no source: it takes the unit's dtype, whichever place it has in the unit).
    std::optional<DType> sourced_dtype;
    for (size_t m = u; m < model.modules.size() && !sourced_dtype; ++m) {
      const ModelModule& mod = model.modules[m];
      if (!InSubtree(unit_name, mod.name)) break;
      if (owner[m] != u) continue;
      for (const auto& [local, pi] : mod.params) {
        if (taken[pi] || !source[pi]) continue;
        sourced_dtype = StoredDType(source[pi]->dtype, *policy);
        break;
      }
    }
    for (size_t m = u; m < model.modules.size(); ++m) {
      const ModelModule& mod = model.modules[m];
      // Pre-order: the unit's subtree is the run of modules starting at the unit's module.
      if (!InSubtree(unit_name, mod.name)) break;
      if (owner[m] != u) continue;  // flattened by a nested unit
      const std::string rel =
          unit_name.empty() ? mod.name
                            : (mod.name.size() == unit_name.size()
                                   ? std::string()
                                   : mod.name.substr(unit_name.size() + 1));
      for (const auto& [local, pi] : mod.params) {
        const std::string fqn = rel.empty() ? local : rel + "." + local;
        // A tied parameter another unit flattened first: with use_orig_params FSDP skips it
        // (the original parameter stays alive, marked flattened); without, materialising the
        // meta model module by module gives this unit's module a parameter of its own
        // (reshard.fsdp1_param_init_fn), so the unit takes a copy (fsdp-layouts R14).
        if (taken[pi] && !in_unit[pi] && layout.use_orig_params) continue;
        if (in_unit[pi]) {
          flat->shared.push_back(fqn);
          continue;
        }
        const SourceTensor* s = source[pi];
        if (!s && !sourced_dtype) {
          Fail(ErrorCode::kUnsupported,
               "unit \"" + unit_name + "\" holds only parameters the model computes at load (" +
                   model.params[pi].names.front() +
                   ", not in the checkpoint), so its dtype is unknown; wrap its module "
                   "together with others");
        }
        const DType stored = s ? StoredDType(s->dtype, *policy) : *sourced_dtype;
        if (!unit_dtype) {
          unit_dtype = stored;
          first_param = fqn;
          if (stored != DType::kF32 && stored != DType::kF64 && stored != DType::kF16 &&
              stored != DType::kBF16) {
            Fail(ErrorCode::kUnsupported,
                 "unit \"" + unit_name + "\": parameter " + fqn + " is " +
                     std::string(Name(stored)) +
                     "; FSDP1 flat parameters of F16, BF16, F32 or F64 are supported");
          }
        } else if (stored != *unit_dtype) {
          // from_pretrained keeps some modules in fp32 (_keep_in_fp32_modules): FSDP1 needs
          // them in units of their own, which the wrap classes can give unless the unit's own
          // module holds both.
          Fail(ErrorCode::kUnsupported,
               "unit \"" + unit_name + "\" mixes dtypes (" + first_param + " is " +
                   std::string(Name(*unit_dtype)) + ", " + fqn + " is " +
                   std::string(Name(stored)) + "); FSDP1 flattens one dtype per unit: " +
                   (mod.name == unit_name
                        ? std::string()
                        : "wrap the " + mod.cls + " modules in units of their own (--wrap " +
                              mod.cls + ", with the other --wrap classes) or ") +
                   "pass --dtype bf16|fp16|fp32");
        }
        if (layout.use_orig_params) {
          const uint64_t a = 16 / (Info(param_dtype.value_or(stored)).bits / 8);
          flat->aligned_numel = a;
          const uint64_t pad = a - total % a;
          if (pad > 0 && pad < a) total += pad;
        }
        FlatParamInfo info;
        info.fqn = fqn;
        info.key = s ? s->name : std::string();  // "": computed by the model at load
        info.shape = s ? s->shape : model.params[pi].shape;
        info.numel = NumelOf(info.shape, "parameter " + fqn);
        info.offset = total;
        total = CheckedAdd(total, info.numel, "unit \"" + unit_name + "\" numel");
        flat->params.push_back(std::move(info));
        taken[pi] = in_unit[pi] = true;
      }
    }
    if (flat->params.empty()) continue;  // FSDP1 gives such a unit no FlatParameter
    if (layout.use_orig_params) {
      const uint64_t pad = layout.world_size - total % layout.world_size;
      if (pad > 0 && pad < layout.world_size) total += pad;
    }
    flat->numel = total;
    plan.units.push_back(std::move(flat));
  }

  std::set<std::string> used;
  for (const auto* s : source) {
    if (s) used.insert(s->name);
  }
  for (const auto& b : model.buffers) {
    if (!b.persistent) continue;
    const SourceTensor* s = FindSourceTensor(ckpt, b.name, model.base_model_prefix);
    if (!s) continue;  // the loader reports it when the model needs it
    if (s->shape != b.shape) {
      Fail(ErrorCode::kMismatch, ckpt.dir.string() + ": buffer " + b.name +
                                     " has another shape in the checkpoint (" + s->name + ")");
    }
    if (used.insert(s->name).second) plan.buffers.push_back(s - ckpt.tensors.data());
  }
  for (const auto& t : ckpt.tensors) {
    if (!used.count(t.name)) plan.unused.push_back(t.name);
  }
  return plan;
}

uint64_t FlatPaddingBits(DType dtype) {
  switch (dtype) {
    case DType::kF32: return 0x42280000u;
    case DType::kF64: return 0x4045000000000000ull;
    case DType::kBF16: return 0x4228u;
    case DType::kF16: return 0x5140u;
    default:
      Fail(ErrorCode::kUnsupported,
           "FSDP1 flat parameters of " + std::string(Name(dtype)) + " are not supported");
  }
}


}  // namespace reshard
