// Json: a walk over the message's descriptor; numbers printed exactly (integers in full, doubles in
// the shortest form that reads back to the same value).
#include "client/ctl/json.h"

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/json_text.h"
#include "google/protobuf/descriptor.h"

namespace moesnap::ctl {
namespace {

using google::protobuf::FieldDescriptor;
using google::protobuf::Message;
using google::protobuf::Reflection;

// "StepState" -> "STEP_STATE_".
std::string EnumPrefix(absl::string_view type_name) {
  std::string prefix;
  for (size_t i = 0; i < type_name.size(); ++i) {
    const char c = type_name[i];
    if (i > 0 && absl::ascii_isupper(c)) prefix += '_';
    prefix += absl::ascii_toupper(c);
  }
  return prefix + "_";
}

void AppendMessage(const Message& message, std::string& out);

void AppendValue(const Message& message, const FieldDescriptor& field, int index, std::string& out) {
  const Reflection& reflection = *message.GetReflection();
  const bool repeated = field.is_repeated();
  switch (field.cpp_type()) {
    case FieldDescriptor::CPPTYPE_INT32:
      absl::StrAppend(&out, repeated ? reflection.GetRepeatedInt32(message, &field, index)
                                     : reflection.GetInt32(message, &field));
      return;
    case FieldDescriptor::CPPTYPE_INT64:
      absl::StrAppend(&out, repeated ? reflection.GetRepeatedInt64(message, &field, index)
                                     : reflection.GetInt64(message, &field));
      return;
    case FieldDescriptor::CPPTYPE_UINT32:
      absl::StrAppend(&out, repeated ? reflection.GetRepeatedUInt32(message, &field, index)
                                     : reflection.GetUInt32(message, &field));
      return;
    case FieldDescriptor::CPPTYPE_UINT64:
      absl::StrAppend(&out, repeated ? reflection.GetRepeatedUInt64(message, &field, index)
                                     : reflection.GetUInt64(message, &field));
      return;
    case FieldDescriptor::CPPTYPE_DOUBLE:
      out += JsonNumber(repeated ? reflection.GetRepeatedDouble(message, &field, index)
                             : reflection.GetDouble(message, &field));
      return;
    case FieldDescriptor::CPPTYPE_FLOAT:
      out += JsonNumber(repeated ? reflection.GetRepeatedFloat(message, &field, index)
                             : reflection.GetFloat(message, &field));
      return;
    case FieldDescriptor::CPPTYPE_BOOL:
      out += (repeated ? reflection.GetRepeatedBool(message, &field, index)
                       : reflection.GetBool(message, &field))
                 ? "true"
                 : "false";
      return;
    case FieldDescriptor::CPPTYPE_ENUM:
      out += JsonString(EnumWord(repeated ? *reflection.GetRepeatedEnum(message, &field, index)
                                          : *reflection.GetEnum(message, &field)));
      return;
    case FieldDescriptor::CPPTYPE_STRING: {
      const std::string text = repeated ? reflection.GetRepeatedString(message, &field, index)
                                        : reflection.GetString(message, &field);
      out += JsonString(field.type() == FieldDescriptor::TYPE_BYTES ? absl::Base64Escape(text) : text);
      return;
    }
    case FieldDescriptor::CPPTYPE_MESSAGE:
      AppendMessage(repeated ? reflection.GetRepeatedMessage(message, &field, index)
                             : reflection.GetMessage(message, &field),
                    out);
      return;
  }
}

void AppendMessage(const Message& message, std::string& out) {
  const Reflection& reflection = *message.GetReflection();
  const google::protobuf::Descriptor& descriptor = *message.GetDescriptor();
  out += '{';
  bool first = true;
  for (int i = 0; i < descriptor.field_count(); ++i) {
    const FieldDescriptor& field = *descriptor.field(i);
    if (!field.is_repeated() && field.has_presence() && !reflection.HasField(message, &field)) continue;
    if (!first) out += ',';
    first = false;
    absl::StrAppend(&out, JsonString(field.name()), ":");
    if (!field.is_repeated()) {
      AppendValue(message, field, 0, out);
      continue;
    }
    out += '[';
    for (int index = 0; index < reflection.FieldSize(message, &field); ++index) {
      if (index > 0) out += ',';
      AppendValue(message, field, index, out);
    }
    out += ']';
  }
  out += '}';
}

}  // namespace

std::string EnumWord(const google::protobuf::EnumValueDescriptor& value) {
  absl::string_view name = value.name();
  const std::string prefix = EnumPrefix(value.type()->name());
  if (absl::StartsWith(name, prefix) && name.size() > prefix.size()) name.remove_prefix(prefix.size());
  return absl::AsciiStrToLower(name);
}

std::string Json(const google::protobuf::Message& message) {
  std::string out;
  AppendMessage(message, out);
  return out + "\n";
}

std::string JsonError(absl::string_view code, absl::string_view message, int exit_code) {
  return absl::StrCat("{\"error\":{\"code\":", JsonString(code), ",\"message\":", JsonString(message),
                      ",\"exit_code\":", exit_code, "}}\n");
}

}  // namespace moesnap::ctl
