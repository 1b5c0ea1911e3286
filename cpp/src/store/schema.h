#pragma once
// The database schema as numbered migrations. Migration i (1-based) takes a database at
// PRAGMA user_version = i-1 to i; they are applied in order at open, each in a transaction.
// Append new migrations at the end; never edit one that has shipped.

#include <vector>

namespace cartridges::schema {

const std::vector<const char*>& migrations();

}  // namespace cartridges::schema
